"""Process-level runtime: allocator tuning and data-parallel process-group facts."""
