"""Everything but generation: probes, metrics, the served table and the debug view (merged over
the workers), model listing and the profiler broadcast. Speed does not matter here; Quart serves it.
"""
