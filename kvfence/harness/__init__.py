"""What tests, benchmarks and the lab share to drive a real server: start and stop clusters, read SSE
streams, generate load and account for injected faults. Importable and typed; nothing here is a test."""
