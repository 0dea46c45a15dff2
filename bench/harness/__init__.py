"""What every benchmark stands on; nothing here is an entry point.

`results`: where figures go and the one JSON report writer; `tables`: the Markdown tables;
`stats`: `quantile` and `ratio`, written once;
`cpu`: a process's CPU time from /proc; `mesh_ready`: a benchmark's mesh settings and waiting for
its workers to attach; `load_plan` and `load_pool`: the open-loop load engine (a pre-built Poisson
plan replayed by load processes) and its per-request `send_result`s. The mesh's processes
themselves are started by tools/testbed, which the tests share.
"""
