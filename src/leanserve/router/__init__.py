"""``leanserve router``: an OpenAI-compatible proxy in front of leanserve servers.

It load-balances aggregated replicas (``--backend``) or runs the disaggregated request flow of
prefill and decode workers (``--prefill``/``--decode``). It is an HTTP relay: its modules import
no engine, model or torch code (only the server's error shapes, ``server/protocol.py``), and its
own added latency is measured (``leanserve:router_added_latency_seconds``).

  config      the router's settings and their checks
  pool        backends per role, their counters, and the policies that pick one
  health      the background task that takes failing backends out of rotation and puts them back
  clock       the router's added latency per request (what counts, and what does not)
  transport   the pool of keep-alive connections (httpx's transport over asyncio sockets)
  upstream    sending one request to a backend (connect-time retry) and relaying its answer
  disagg      the prefill -> decode request flow
  app         the ASGI app (routes, client disconnects, lifespan) and serve()
  metrics     Prometheus text for /metrics
  latency_bench  the added-latency microbenchmark behind bench/results/router.txt
"""
