"""Reward shaping that depends on the completion's length, not its content.

Owns the penalties added to a completion's reward because of how long it is (DAPO's soft overlong punishment).
Does not own judging the content (the verifiers in `rewards/`), where the penalty is added, nor the choice of
max_length and buffer (the config). Pure Python: no torch, no Ray.
"""

from __future__ import annotations


def overlong_penalty(length: int, max_length: int, buffer: int, penalty: float = 1.0) -> float:
    """Soft overlong punishment: 0 up to max_length - buffer, then a linear ramp down to -penalty at max_length.

    DAPO, Yu et al. 2025 ("DAPO: An Open-Source LLM Reinforcement Learning System at Scale", eq. 13), with
    L_max = max_length, L_cache = buffer, scaled by penalty:
        R(y) = 0                                       if |y| <= L_max - L_cache,
               ((L_max - L_cache) - |y|) / L_cache     if L_max - L_cache < |y| <= L_max,
               -1                                      if L_max < |y|.
    The ramp tells the policy a completion is getting too long before truncation would cut it off unjudged.

    Args:
        length: |y|, tokens in the completion, >= 0.
        max_length: L_max, the length at which the penalty reaches its full size, > buffer.
        buffer: L_cache, the width of the ramp, in [0, max_length); 0 turns the shaping off (always 0).
        penalty: the penalty's full size, >= 0 (the paper's 1).

    Returns:
        The shaping term to add to the completion's reward, in [-penalty, 0].
    """
    if not 0 <= buffer < max_length:
        raise ValueError(f"buffer must be in [0, max_length={max_length}), got {buffer}; use 0 to turn it off")
    if penalty < 0:
        raise ValueError(f"penalty must be >= 0 (it is subtracted from the reward), got {penalty}")
    if length < 0:
        raise ValueError(f"length must be >= 0 (tokens in the completion), got {length}")
    if buffer == 0:
        return 0.0  # shaping off: no ramp, and no cliff at max_length either
    expected_max = max_length - buffer  # L_max - L_cache, the longest completion without penalty
    if length <= expected_max:
        return 0.0
    if length <= max_length:
        return (expected_max - length) / buffer * penalty  # ((L_max - L_cache) - |y|) / L_cache
    return -penalty  # |y| > L_max
