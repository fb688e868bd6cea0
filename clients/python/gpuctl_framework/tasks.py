"""Helpers to build what a launch needs and to read task states."""

from . import common_pb2
from . import scheduler_pb2 as pb

# States after which a task never changes again (UNREACHABLE is not one:
# its agent may come back with the task still running).
TERMINAL_STATES = frozenset({
    common_pb2.TASK_FINISHED, common_pb2.TASK_FAILED, common_pb2.TASK_KILLED,
    common_pb2.TASK_LOST, common_pb2.TASK_ERROR,
})


def task_info(task_id, agent_id, command, gpu_uuids=(), cpus=0.1, mem_mib=32,
              image="", env=None, name="", gpu_fraction=None):
    """A TaskInfo for Framework.accept().

    task_id: chosen by the framework, unique within it (1 to 128 of
        A-Z a-z 0-9 . _ -).
    agent_id: the agent of the offer it runs on.
    command: argv, e.g. ["sh", "-c", "nvidia-smi"].
    gpu_uuids: exactly which of the offer's GPUs it uses (Offer.gpus[i].uuid);
        resources.gpus is their count.
    image: a container image; empty runs the command as a host process.
    gpu_fraction: instead of GPUs, a fraction of one of the offer's shared
        GPUs (Offer.shared_gpus[i]): (gpu_uuid, mem_mib) or (gpu_uuid,
        mem_mib, compute_pct), or a scheduler_pb2.GpuFraction. The task
        names no GPU in gpu_uuids then.
    """
    if isinstance(command, str):
        raise TypeError("command is an argv list, e.g. ['sh', '-c', %r]" % command)
    if gpu_fraction is not None and gpu_uuids:
        raise ValueError("a task asks GPUs (gpu_uuids) or a fraction of one (gpu_fraction), "
                         "not both")
    if gpu_fraction is not None and not isinstance(gpu_fraction, pb.GpuFraction):
        gpu_fraction = pb.GpuFraction(**dict(zip(("gpu_uuid", "mem_mib", "compute_pct"),
                                                  gpu_fraction)))
    return pb.TaskInfo(
        task_id=task_id, name=name or task_id, agent_id=agent_id, image=image,
        command=list(command), env=dict(env or {}),
        resources=common_pb2.Resources(cpus=cpus, mem_mib=mem_mib, gpus=len(gpu_uuids)),
        gpu_uuids=list(gpu_uuids), gpu_fraction=gpu_fraction)


def is_terminal(state):
    """Whether a TaskState is final."""
    return state in TERMINAL_STATES


def state_name(state):
    """"RUNNING" for TASK_RUNNING ("STATE_12" for a state newer than the stubs)."""
    try:
        return common_pb2.TaskState.Name(state).replace("TASK_", "", 1)
    except ValueError:
        return "STATE_%d" % state


def reason_name(reason):
    """"AGENT_LOST" for REASON_AGENT_LOST; "" for REASON_UNSPECIFIED."""
    if reason == pb.REASON_UNSPECIFIED:
        return ""
    try:
        return pb.Reason.Name(reason).replace("REASON_", "", 1)
    except ValueError:
        return "REASON_%d" % reason
