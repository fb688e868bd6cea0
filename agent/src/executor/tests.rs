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
    let gpu = StopReason::GpuFailed("GPU g unhealthy: lost".into());
    let o = Outcome::ran(code(143), Some(&gpu), 0);
    assert_eq!((o.state, o.gpu_unhealthy), (TaskState::Failed, true));
    assert_eq!(o.message, "GPU g unhealthy: lost");
    // Finished cleanly before the GPU's failure stopped it.
    let o = Outcome::ran(code(0), Some(&gpu), 0);
    assert_eq!(o.state, TaskState::Finished);
    // Fenced by its supervisor while the agent was away.
    let fenced = Ended {
        code: Some(143),
        fenced: true,
        error: None,
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
    let o = Outcome::refused(&StopReason::GpuFailed("GPU g unhealthy: x".into()), 0);
    assert_eq!((o.state, o.gpu_unhealthy), (TaskState::Failed, true));
}
