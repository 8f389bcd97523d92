"""Verifiable-reward tasks: procedural arithmetic and countdown, JSONL question/answer sets, and
reasoning-gym's procedural data sets."""

from .answers import extract_answer, gsm8k, normalize_answer
from .arithmetic import ArithmeticTask, arithmetic_exact
from .base import Example, RewardFn, Task
from .countdown import CountdownTask, countdown
from .jsonl import JsonlTask
from .math_reward import math_verify_reward
from .reasoning_gym import ReasoningGymTask
from .registry import check_jsonl, get_task, task_names
from .rewards import REWARDS, load_reward, named_reward, reward_names

__all__ = [
    "REWARDS",
    "ArithmeticTask",
    "CountdownTask",
    "Example",
    "JsonlTask",
    "ReasoningGymTask",
    "RewardFn",
    "Task",
    "arithmetic_exact",
    "check_jsonl",
    "countdown",
    "extract_answer",
    "get_task",
    "gsm8k",
    "load_reward",
    "math_verify_reward",
    "named_reward",
    "normalize_answer",
    "reward_names",
    "task_names",
]
