"""The parts of the prefix-affinity policy (pdserve.proxy.policies.prefix_affinity): prompts cut
into chained chunk hashes, the bounded per-slot index of what was sent where, and the choice."""
