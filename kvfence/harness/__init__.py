"""What tests, benchmarks and the lab share to drive a real server: start and stop clusters, read SSE
streams, generate load and account for injected faults. Importable and typed; nothing here is a test.

  server.py      one app under uvicorn on loopback (serve, serving), free ports, /metrics, the audit trail
  procs.py       `kvfence` commands as OS processes: launch, wait until ready, stop with descendants
  cluster.py     the one way to start and stop a cluster (single node, or router + prefill + decode)
  sse.py         the one SSE parser
  load.py        tenants, jobs and the load generator (run_job, drive)
  references.py  offline greedy references and the near-tie comparison
  ledger.py      which injected faults took effect, and on whom
  judge.py       the rules a load run must meet (RunReport.problems)
  runs.py        load runs end to end, single node and disaggregated
  tables.py      plain-text tables
  offline_engine.py  the benchmarks' weights, engines and prompts
  contention.py  the shared machine: others' CPU share, waiting for a quiet one
  timings.py     a run's request timings, its result and its table row
  timed_runs.py  timed runs: an engine stepped here, or streams to a server
  hf_baseline.py HF transformers' generate() as the baseline
  bandwidth.py   memory-bandwidth ceilings of decode
  served_systems.py  a `kvfence serve` system as processes, loaded and timed with its per-process CPU
  trail_transfer.py  KV transfer rates from disaggregated requests' audit trails
  curve_cost.py  CURVE against the plain transport over rounds
  page_handoff.py, page_stream.py  one page's handoff stage by stage; pages streamed between connectors
  verdicts.py, results.py  a benchmark's verdicts and its JSON

Floor: above engine/, disagg/ and api/, below audit/ and the CLI (tests/unit/test_layering.py). Importing
this package imports none of its modules, so `kvfence.harness.sse` stays free of torch.
"""
