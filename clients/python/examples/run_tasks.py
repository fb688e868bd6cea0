#!/usr/bin/env python3
"""Runs N copies of a command on a gpuctl cluster through the framework API.

    run_tasks.py --master 127.0.0.1:7050 --tasks 3 --gpus-per-task 1 -- \\
        sh -c 'echo $NVIDIA_VISIBLE_DEVICES'

Each task takes GPUs that an offer names, or with --gpu-mem a fraction of a
shared GPU the offer names (`gpuctl gpus share`). Progress goes to stderr; at
the end one line per task goes to stdout (`task-0 FINISHED exit=0 agent=...
gpus=...`).
Exits 0 only if every task FINISHED, 1 otherwise, 2 on timeout.
"""

import argparse
import logging
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import grpc  # noqa: E402

from gpuctl_framework import (Framework, FrameworkError, is_terminal,  # noqa: E402
                              not_proposed, reason_name, state_name, task_info)
from gpuctl_framework import common_pb2, scheduler_pb2  # noqa: E402


class Task:
    def __init__(self, index):
        self.id = "task-%d" % index
        self.state = None         # None: not launched (waits for an offer)
        self.in_doubt = False     # an Accept failed without saying it did nothing
        self.exit_code = None
        self.agent_id = ""
        self.gpus = []
        self.fraction = None      # (gpu_uuid, mem_mib, compute_pct) of a shared GPU

    def line(self):
        exit_code = "" if self.exit_code is None else " exit=%d" % self.exit_code
        state = "PENDING" if self.state is None else state_name(self.state)
        return "%s %s%s agent=%s gpus=%s" % (self.id, state, exit_code, self.agent_id or "-",
                                             ",".join(self.gpus) or "-")


def try_call(call, *args):
    """A call whose failure needs no more than a line (a declined offer
    times out anyway, and after UNAVAILABLE the client subscribes again).
    Returns whether it succeeded."""
    try:
        call(*args)
        return True
    except (grpc.RpcError, FrameworkError) as err:
        why = "%s: %s" % (err.code().name, err.details()) if isinstance(err, grpc.RpcError) else err
        print("%s failed: %s" % (call.__name__, why), file=sys.stderr)
        return False


def pack_fractions(offer, pending, args):
    """Takes from `pending` the tasks whose fractions fit in `offer`'s shared
    GPUs, filling one GPU before the next."""
    cpus, mem = offer.resources.cpus, offer.resources.mem_mib
    chosen = []
    for shared in offer.shared_gpus:
        room_mem, room_pct = shared.free_mem_mib, shared.free_compute_pct
        while (pending and room_mem >= args.gpu_mem and room_pct >= args.gpu_compute
               and cpus >= args.cpus and mem >= args.mem_mib):
            task = pending.pop(0)
            task.agent_id, task.gpus = offer.agent_id, [shared.gpu.uuid]
            task.fraction = (shared.gpu.uuid, args.gpu_mem, args.gpu_compute)
            room_mem, room_pct = room_mem - args.gpu_mem, room_pct - args.gpu_compute
            cpus, mem = cpus - args.cpus, mem - args.mem_mib
            chosen.append(task)
    return chosen


def pack(offer, pending, args):
    """Takes from `pending` the tasks that fit in `offer`, naming its GPUs."""
    if args.gpu_mem:
        return pack_fractions(offer, pending, args)
    gpus = [g.uuid for g in offer.gpus if g.healthy]
    cpus, mem = offer.resources.cpus, offer.resources.mem_mib
    chosen = []
    while pending and len(gpus) >= args.gpus_per_task and cpus >= args.cpus and mem >= args.mem_mib:
        task = pending.pop(0)
        task.agent_id, task.gpus = offer.agent_id, gpus[:args.gpus_per_task]
        del gpus[:args.gpus_per_task]
        cpus, mem = cpus - args.cpus, mem - args.mem_mib
        chosen.append(task)
    return chosen


def on_offers(fw, offers, tasks, args):
    for offer in offers:
        pending = [t for t in tasks if t.state is None and not t.in_doubt]
        chosen = pack(offer, pending, args)
        if not chosen:
            try_call(fw.decline, offer.id, 5)
            continue
        infos = [task_info(t.id, t.agent_id, args.command,
                           gpu_uuids=() if t.fraction else t.gpus, gpu_fraction=t.fraction,
                           cpus=args.cpus, mem_mib=args.mem_mib, image=args.image)
                 for t in chosen]
        for t in chosen:
            what = ",".join(t.gpus) or "no GPU"
            if t.fraction:
                what = "%d MiB of %s" % (t.fraction[1], t.fraction[0])
            print("%s launching on %s with %s" % (t.id, t.agent_id, what), file=sys.stderr)
        try:
            # Refuse the rest of the offer briefly: more tasks may fit soon.
            fw.accept(offer.id, infos, refuse_seconds=1)
            for t in chosen:
                t.state = common_pb2.TASK_STAGING
        except grpc.RpcError as err:
            print("Accept failed: %s: %s" % (err.code().name, err.details()), file=sys.stderr)
            # UNAVAILABLE without "not proposed": the master may have lost its
            # leadership after launching them. Ask, once subscribed again.
            doubt = err.code() == grpc.StatusCode.UNAVAILABLE and not not_proposed(err)
            for t in chosen:
                t.in_doubt = doubt
            if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise FrameworkError("the master refused the tasks: %s" % err.details())
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                return  # these offers are gone with the old stream


def on_update(fw, update, tasks):
    task = next((t for t in tasks if t.id == update.task_id), None)
    if task is None:
        return
    if (task.in_doubt and update.state == common_pb2.TASK_LOST
            and update.reason == scheduler_pb2.REASON_RECONCILIATION):
        # The answer to our Reconcile: the master never launched it.
        task.in_doubt = False
        print("%s was not launched; it waits for an offer" % task.id, file=sys.stderr)
        return
    task.in_doubt = False
    task.state = update.state
    if update.HasField("exit_code"):
        task.exit_code = update.exit_code
    why = " ".join(x for x in (reason_name(update.reason), update.message) if x)
    print("%s %s%s" % (task.id, state_name(update.state), " (%s)" % why if why else ""),
          file=sys.stderr)
    # Until acknowledged, the agent holds the task's next update. The master
    # forwards an update once per subscription: subscribing again brings
    # back one whose Acknowledge failed.
    if not fw.auto_acknowledge and not try_call(fw.acknowledge, update):
        fw.resubscribe()


def run(fw, tasks, args):
    suppressed = False
    for event in fw.events():
        kind = event.WhichOneof("event")
        if kind == "subscribed":
            print("subscribed as %s" % event.subscribed.framework_id, file=sys.stderr)
            suppressed = False  # a new leader knows nothing of our Suppress
            doubt = [(t.id, t.agent_id) for t in tasks if t.in_doubt]
            if doubt:
                try_call(fw.reconcile, doubt)
        elif kind == "offers":
            on_offers(fw, event.offers.offers, tasks, args)
        elif kind == "update":
            on_update(fw, event.update, tasks)
        if all(t.state is not None and is_terminal(t.state) for t in tasks):
            return
        waiting = any(t.state is None and not t.in_doubt for t in tasks)
        try:
            if suppressed == waiting:  # offers needed and stopped, or the reverse
                (fw.revive if waiting else fw.suppress)()
                suppressed = not waiting
        except grpc.RpcError as err:
            print("Suppress/Revive failed: %s" % err.details(), file=sys.stderr)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--master", default=os.environ.get("GPUCTL_MASTER", "127.0.0.1:7050"),
                        help="masters, HOST:PORT[,HOST:PORT...]; the leader is found among them")
    parser.add_argument("--tasks", type=int, default=1)
    parser.add_argument("--gpus-per-task", type=int, default=1)
    parser.add_argument("--cpus", type=float, default=0.1, help="CPUs per task")
    parser.add_argument("--mem-mib", type=int, default=32, help="memory per task")
    parser.add_argument("--gpu-mem", type=int, default=0, metavar="MIB",
                        help="each task takes this much of a shared GPU's memory instead of "
                             "whole GPUs (--gpus-per-task is then ignored)")
    parser.add_argument("--gpu-compute", type=int, default=0, metavar="PCT",
                        help="with --gpu-mem: percent of the shared GPU's compute per task")
    parser.add_argument("--image", default="", help="container image (default: a host process)")
    parser.add_argument("--name", default="run-tasks")
    parser.add_argument("--timeout", type=int, default=120, help="give up (exit 2) after this")
    parser.add_argument("--auto-acknowledge", action="store_true",
                        help="let the client acknowledge updates (default: the example does)")
    parser.add_argument("--tls-dir", default=os.environ.get("GPUCTL_TLS_DIR"),
                        help="ca.crt, client.crt and client.key of a cluster with TLS")
    parser.add_argument("--token", default=os.environ.get("GPUCTL_TOKEN"),
                        help="a framework token (gpuctl tokens create --role framework)")
    parser.add_argument("--role", default="default", help="the allocator role to subscribe with")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARG...]")
    args = parser.parse_args()
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command given (put it after --)")
    if args.tasks < 1 or args.gpus_per_task < 0:
        parser.error("--tasks must be at least 1 and --gpus-per-task at least 0")
    if args.gpu_mem < 0 or not 0 <= args.gpu_compute <= 100 or (args.gpu_compute
                                                                 and not args.gpu_mem):
        parser.error("--gpu-mem is MiB (> 0), --gpu-compute a percent (0-100) with --gpu-mem")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")

    def timed_out(*_):
        raise TimeoutError("timed out after %d s" % args.timeout)
    signal.signal(signal.SIGALRM, timed_out)
    signal.alarm(args.timeout)

    tasks = [Task(i) for i in range(args.tasks)]
    fw = Framework(args.master, name=args.name, failover_timeout=60,
                   roles=(args.role,), auto_acknowledge=args.auto_acknowledge,
                   tls_dir=args.tls_dir, token=args.token)
    code = 1
    try:
        run(fw, tasks, args)
        code = 0 if all(t.state == common_pb2.TASK_FINISHED for t in tasks) else 1
    except TimeoutError as err:
        print("run_tasks: %s" % err, file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    except FrameworkError as err:
        print("run_tasks: %s" % err, file=sys.stderr)
    finally:
        signal.alarm(0)
        try:
            # Kills whatever still runs; left behind, it would run until
            # the failover timeout.
            fw.teardown()
        except grpc.RpcError as err:
            print("run_tasks: Teardown failed: %s" % err.details(), file=sys.stderr)
    for t in tasks:
        print(t.line())
    return code


if __name__ == "__main__":
    sys.exit(main())
