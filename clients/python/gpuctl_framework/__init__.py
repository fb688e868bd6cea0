"""A Python client of gpuctl's framework API (docs/framework-api.md).

    from gpuctl_framework import Framework, task_info

The generated messages are in `gpuctl_framework.scheduler_pb2` (Event,
Offer, TaskInfo, TaskStatus, ...) and `gpuctl_framework.common_pb2` (Gpu,
Resources, TaskState, ...); regenerate them with ../generate.sh.
"""

from . import common_pb2, scheduler_pb2
from .framework import (Framework, FrameworkError, FrameworkRemoved, NoMaster,
                        leader_hint, not_proposed)
from .tasks import TERMINAL_STATES, is_terminal, reason_name, state_name, task_info

__all__ = [
    "Framework", "FrameworkError", "FrameworkRemoved", "NoMaster",
    "leader_hint", "not_proposed", "task_info", "is_terminal", "state_name",
    "reason_name", "TERMINAL_STATES", "common_pb2", "scheduler_pb2",
]
