"""Constants of the device cache's admission policy, shared by the kernel and its twin.

DECAY_SHIFT: every decode step each expert's pick frequency loses 1/2^DECAY_SHIFT of itself
(picked experts gain 1024), so the filter that admits a miss only over a less-used victim
averages over about 2^DECAY_SHIFT steps. Under the real GLM-5.3-Flash statistics an average over
256 steps (shift 8) was noisy enough to swap popular experts out for lucky ones; 4,096 steps
(shift 12), with the warm start from the statistics, keeps the slots on the truly popular
experts and reaches the static-placement bound of `tiermoe sim` (results section 19).
"""

DECAY_SHIFT = 12

# The disk tier's RAM (moe/disk_tier.py) re-reads its eviction order from the device's decayed pick counts every
# HEAT_STEPS decode steps (a small copy after the step's sync).
HEAT_STEPS = 32
