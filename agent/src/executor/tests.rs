use gpuctl_core::types::TaskShare;

use super::*;
use crate::runtime::Ended;

#[test]
fn mps_daemons_are_per_tenant_and_user() {
    let share = |tenant: &str| TaskShare {
        fraction: gpuctl_core::types::GpuFraction {
            mem_mib: 1024,
            compute_pct: 0,
        },
        mode: ShareMode::Mps,
        tenant: tenant.into(),
    };
    let u = |uid| Some(UserIds { uid, gid: uid });
    assert_eq!(mps_group(&share("team-a"), u(65534)), "team-a.u65534");
    // An MPS daemon serves one user at a time: two users, two daemons.
    assert_ne!(
        mps_group(&share("team-a"), u(1000)),
        mps_group(&share("team-a"), u(1001))
    );
    assert_ne!(
        mps_group(&share("team-a"), u(1000)),
        mps_group(&share("team-b"), u(1000))
    );
    assert_eq!(mps_group(&share(""), None), "default.image");
}

#[test]
fn a_fraction_seen_near_its_memory_is_told_why_it_may_have_failed() {
    assert_eq!(near_fraction(9000, 10240), None);
    let hint = near_fraction(9800, 10240).unwrap();
    assert!(
        hint.contains("9800 MiB of its 10240 MiB fraction") && hint.contains("out-of-memory"),
        "{hint}"
    );
    assert!(near_fraction(10240, 10240).is_some());
    assert_eq!(near_fraction(0, 0), None);
}

#[test]
fn signal_deaths_and_oom_kills_are_named() {
    let ended = |code, signal, oom_killed| Ended {
        code: Some(code),
        signal,
        oom_killed,
        ..Default::default()
    };
    // The process runtime knows the signal.
    let o = Outcome::ran(ended(137, Some(9), false), None, 0);
    assert_eq!((o.state, o.exit_code), (TaskState::Failed, Some(137)));
    assert_eq!(o.message, "killed by signal 9 (SIGKILL)");
    // Docker has only the code: said as what it most likely is.
    let o = Outcome::ran(ended(143, None, false), None, 0);
    assert_eq!(
        o.message,
        "exited with code 143, as a process killed by signal 15 (SIGTERM) does"
    );
    // An OOM kill is said as one, whatever the code.
    let o = Outcome::ran(ended(137, Some(9), true), None, 0);
    assert!(
        o.message.starts_with("OOM-killed (exit code 137)"),
        "{}",
        o.message
    );
    // Plain codes stay as they were; a code past 128 + 64 is no signal.
    assert_eq!(
        Outcome::ran(ended(3, None, false), None, 0).message,
        "exited with code 3"
    );
    assert_eq!(
        Outcome::ran(ended(255, None, false), None, 0).message,
        "exited with code 255"
    );
    // A task that exits 0 succeeded, even if one of its processes was
    // OOM-killed on the way.
    assert_eq!(
        Outcome::ran(ended(0, None, true), None, 0).state,
        TaskState::Finished
    );
    // Stopped as hung, it failed, even if it exits 0 on the SIGTERM.
    let hung = StopReason::Hung("hung: no output and no GPU activity for 60 s".into());
    let o = Outcome::ran(ended(0, None, false), Some(&hung), 0);
    assert_eq!(
        (o.state, o.hung, o.exit_code),
        (TaskState::Failed, true, Some(0))
    );
    assert!(o.message.starts_with("hung: "), "{}", o.message);
    // Stopped by its runtime's restart: said as such, with the code, and
    // marked for the master (no retry used); a kill the agent asked for
    // stays a kill, and a task that finished stays finished.
    let restarted = Ended {
        runtime_restarted: true,
        ..ended(143, None, false)
    };
    let o = Outcome::ran(restarted.clone(), None, 0);
    assert_eq!(
        (o.state, o.runtime_restarted, o.exit_code),
        (TaskState::Failed, true, Some(143))
    );
    assert!(
        o.message
            .starts_with("was stopped by its container runtime as the runtime restarted (exited with code 143, as a process killed by signal 15 (SIGTERM) does;"),
        "{}",
        o.message
    );
    let o = Outcome::ran(restarted, Some(&StopReason::Killed), 0);
    assert_eq!((o.state, o.runtime_restarted), (TaskState::Killed, false));
    let ok = Ended {
        runtime_restarted: true,
        ..ended(0, None, false)
    };
    assert_eq!(Outcome::ran(ok, None, 0).state, TaskState::Finished);
}

#[test]
fn outcomes_of_a_task_that_ran() {
    let code = |c| Ended {
        code: Some(c),
        ..Default::default()
    };
    let o = Outcome::ran(code(0), None, 0);
    assert_eq!((o.state, o.exit_code), (TaskState::Finished, Some(0)));
    let o = Outcome::ran(code(3), None, 0);
    assert_eq!((o.state, o.exit_code), (TaskState::Failed, Some(3)));
    assert_eq!(o.message, "exited with code 3");
    let o = Outcome::ran(code(143), Some(&StopReason::Killed), 0);
    assert_eq!(o.state, TaskState::Killed);
    let gpu = StopReason::GpuFailed {
        why: "GPU g unhealthy: lost".into(),
        gpu: Some("g".into()),
    };
    let o = Outcome::ran(code(143), Some(&gpu), 0);
    assert_eq!((o.state, o.gpu_unhealthy), (TaskState::Failed, true));
    assert_eq!(o.message, "GPU g unhealthy: lost");
    // The master is told which GPU failed: the job avoids it.
    assert_eq!(o.failed_gpus, ["g"]);
    // Finished cleanly before the GPU's failure stopped it.
    let o = Outcome::ran(code(0), Some(&gpu), 0);
    assert_eq!(o.state, TaskState::Finished);
    // Fenced by its supervisor while the agent was away.
    let fenced = Ended {
        code: Some(143),
        fenced: true,
        error: None,
        ..Default::default()
    };
    let o = Outcome::ran(fenced, None, 75_000);
    assert_eq!((o.state, o.fenced), (TaskState::Killed, true));
    assert!(o.message.contains("75 s"), "{}", o.message);
    let o = Outcome::ran(
        Ended {
            error: Some("container gpuctl-a-t vanished".into()),
            ..Default::default()
        },
        None,
        0,
    );
    assert_eq!((o.state, o.exit_code), (TaskState::Failed, None));
}

#[test]
fn outcomes_of_a_task_that_never_ran() {
    let o = Outcome::refused(&StopReason::Killed, 0);
    assert_eq!(
        (o.state, o.message.as_str()),
        (TaskState::Killed, "killed before it started")
    );
    let o = Outcome::refused(
        &StopReason::GpuFailed {
            why: "GPU g unhealthy: x".into(),
            gpu: None,
        },
        0,
    );
    assert_eq!((o.state, o.gpu_unhealthy), (TaskState::Failed, true));
    assert!(o.failed_gpus.is_empty());
}
