"""Stand-ins for the parts a test or a benchmark of the CPU-side engine cannot have.

FakeModelRunner replaces the torch model runner (there is no model in scheduler tests and
benchmarks); it keeps the same per-request state a real worker keeps, from SchedulerOutput
alone, so it checks the scheduler's contract with the worker as it goes.
"""
