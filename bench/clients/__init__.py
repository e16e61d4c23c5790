"""Load clients: wrk (closed loop), perf_analyzer (V2 closed and open loop), a Poisson client."""
