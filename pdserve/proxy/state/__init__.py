"""What every request reads and writes, router-wide: the slot book (in-flight legs, ejections)
and the shared memory that makes it, the counters and the request ids one across worker processes.
"""
