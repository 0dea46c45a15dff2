from bench.token_path.bench_hop_floor import relay_chain, round_trips_ms


def test_relay_chain_echoes_through_every_hop_and_times_each_round_trip():
    with relay_chain(2) as address:
        times_ms = round_trips_ms(address, num_requests=3, pace_s=0.01)  # waits until the echo equals the payload
    assert len(times_ms) == 3
    assert all(0 < t < 5000 for t in times_ms)
