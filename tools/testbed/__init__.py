"""The mesh as real processes on 127.0.0.1, for the tests and the benchmarks alike.

`processes` starts and stops services by PID on free ports with the session's dev CA (`session_tls`);
`valkey` a quota store; `netns` hosts on a private LAN; `gateway_fixtures`, `scheduler_fixtures`,
`generator_models`, `mesh_load` and `mesh_replicas` are what a test or a benchmark drives them with;
`fake_clock` a clock a simulation advances by hand. Nothing here is a test: tests/support keeps
what only pytest uses.
"""
