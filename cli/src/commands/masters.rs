//! `gpuctl masters`: the masters of the Raft group, and changes to it.

use std::io::Write;

use clap::{Args, Subcommand};
use gpuctl_proto::pb;
use tokio::time::Instant;

use super::{CliError, JsonFlag};
use crate::client::{self, Master, Retry, MEMBERSHIP_TIMEOUT};
use crate::output::{self, MasterJson, Table};

/// `gpuctl masters [--json]`, or one of its subcommands.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct MastersArgs {
    #[command(subcommand)]
    pub command: Option<MastersCommand>,
    #[command(flatten)]
    pub flags: JsonFlag,
}

#[derive(Debug, Subcommand)]
pub enum MastersCommand {
    /// Add a master to the Raft group: it joins as a learner, catches up,
    /// then becomes a voter. Prints the resulting members.
    Add {
        /// Node id of the new master (>= 1, unused in the group).
        #[arg(value_parser = parse_master_id)]
        id: u64,
        /// HOST:PORT of its API (and Raft) listener.
        #[arg(value_name = "HOST:PORT", value_parser = client::parse_address)]
        address: String,
        #[command(flatten)]
        flags: JsonFlag,
    },
    /// Remove a master from the Raft group; removing the leader first hands
    /// leadership to another master. Prints the resulting members.
    Remove {
        /// Node id of the master (see `gpuctl masters`).
        #[arg(value_parser = parse_master_id)]
        id: u64,
        #[command(flatten)]
        flags: JsonFlag,
    },
}

/// A Raft node id: 0 is not one.
pub fn parse_master_id(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(id) if id >= 1 => Ok(id),
        _ => Err(format!("{s:?} is not a master id (a whole number >= 1)")),
    }
}

pub fn masters_table(masters: &[pb::MasterInfo]) -> Table {
    let mut t = Table::new(&[
        "ID", "ADDRESS", "ROLE", "VOTER", "TERM", "COMMIT", "APPLIED",
    ]);
    for m in masters {
        let voter = if m.voter { "yes" } else { "learner" }.to_string();
        if m.reachable {
            t.row(vec![
                m.id.to_string(),
                m.address.clone(),
                m.role.clone(),
                voter,
                m.term.to_string(),
                m.commit_index.to_string(),
                m.applied_index.to_string(),
            ]);
        } else {
            // Empty cells print as "-": nothing is known of it.
            t.row(vec![
                m.id.to_string(),
                m.address.clone(),
                "unreachable".to_string(),
                voter,
            ]);
        }
    }
    t
}

pub async fn run(
    master: &mut Master,
    args: MastersArgs,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    match args.command {
        None => list(master, args.flags.json, out).await,
        Some(MastersCommand::Add { id, address, flags }) => {
            add(master, id, &address, flags.json, out).await
        }
        Some(MastersCommand::Remove { id, flags }) => remove(master, id, flags.json, out).await,
    }
}

pub async fn list(master: &mut Master, json: bool, out: &mut dyn Write) -> Result<(), CliError> {
    // Any master answers this one (no redirect); another is tried only
    // when this one is down.
    let resp = master
        .call(Retry::Always, |mut c| async move {
            c.list_masters(pb::ListMastersRequest {}).await
        })
        .await?;
    print_members(resp, json, out)
}

/// Adds a master. Safe to resend: the master answers an add of a voter
/// already there at the same address with the members.
pub async fn add(
    master: &mut Master,
    id: u64,
    address: &str,
    json: bool,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let deadline = Instant::now() + master.retry_for;
    let resp = master
        .call_until(
            Retry::Resend,
            Some(MEMBERSHIP_TIMEOUT),
            deadline,
            |mut c| {
                let req = pb::AddMasterRequest {
                    id,
                    address: address.to_string(),
                };
                async move { c.add_master(req).await }
            },
        )
        .await
        .map_err(|e| {
            e.unknown_as(
                format!("master {id} may or may not have been added"),
                format!("see `gpuctl masters`; `gpuctl masters add {id} {address}` again is safe"),
            )
        })?;
    print_members(resp, json, out)
}

/// Removes a master. Removing the leader: it hands leadership on and
/// redirects, so the call is sent again to the new leader. Safe to resend:
/// a resend after an unknown outcome that finds the master gone means the
/// earlier try removed it.
pub async fn remove(
    master: &mut Master,
    id: u64,
    json: bool,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let deadline = Instant::now() + master.retry_for;
    let result = master
        .call_until(
            Retry::Resend,
            Some(MEMBERSHIP_TIMEOUT),
            deadline,
            |mut c| async move { c.remove_master(pb::RemoveMasterRequest { id }).await },
        )
        .await;
    let resp = match result {
        Ok(resp) => resp,
        Err(e @ CliError::Unknown { .. }) if removed_already(e.last()) => {
            tracing::debug!(id, "master already removed by an earlier try");
            master
                .call(Retry::Always, |mut c| async move {
                    c.list_masters(pb::ListMastersRequest {}).await
                })
                .await?
        }
        Err(e) => {
            return Err(e.unknown_as(
                format!("master {id} may or may not have been removed"),
                format!("see `gpuctl masters`; `gpuctl masters remove {id}` again is safe"),
            ))
        }
    };
    print_members(resp, json, out)
}

/// Whether a removal's answer says the master is no member (anymore).
fn removed_already(e: &CliError) -> bool {
    matches!(e, CliError::Rpc { status, .. } if status.code() == tonic::Code::NotFound)
}

fn print_members(
    resp: pb::ListMastersResponse,
    json: bool,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let mut masters = resp.masters;
    masters.sort_by_key(|m| m.id);
    if json {
        let items: Vec<MasterJson> = masters.iter().map(MasterJson::from).collect();
        out.write_all(output::to_json(&items)?.as_bytes())?;
    } else {
        out.write_all(masters_table(&masters).render().as_bytes())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::{Cli, Command};
    use crate::error::EXIT_USAGE;
    use clap::Parser;

    fn info(id: u64, role: &str, voter: bool, reachable: bool) -> pb::MasterInfo {
        pb::MasterInfo {
            id,
            address: format!("10.0.0.{id}:7050"),
            role: role.into(),
            term: 3,
            commit_index: 42,
            applied_index: 41,
            answered: id == 1,
            voter,
            reachable,
        }
    }

    #[test]
    fn json_and_table_shapes() {
        let m = info(1, "leader", true, true);
        let v = serde_json::to_value(MasterJson::from(&m)).unwrap();
        assert_eq!(v["role"], "leader");
        assert_eq!(v["commit_index"], 42);
        assert_eq!(v["applied_index"], 41);
        assert_eq!(v["id"], 1);
        assert_eq!(v["voter"], true);
        assert_eq!(v["reachable"], true);
        let t = masters_table(&[m]).render();
        assert!(t.starts_with("ID"), "{t}");
        assert!(t.lines().next().unwrap().contains("VOTER"), "{t}");
        assert!(t.contains("10.0.0.1:7050") && t.contains("leader"), "{t}");
        assert!(t.contains("yes"), "{t}");
    }

    #[test]
    fn learners_and_unreachable_members_are_marked() {
        let t = masters_table(&[
            info(1, "leader", true, true),
            info(2, "follower", false, true),
            info(3, "unknown", true, false),
        ])
        .render();
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[2].contains("learner"), "{t}");
        assert!(lines[3].contains("unreachable"), "{t}");
        assert!(
            !lines[3].contains("42"),
            "indexes of an unreachable master: {t}"
        );
        let v = serde_json::to_value(MasterJson::from(&info(3, "unknown", true, false))).unwrap();
        assert_eq!(v["reachable"], false);
        assert_eq!(v["role"], "unknown");
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("gpuctl").chain(args.iter().copied()))
    }

    #[test]
    fn add_and_remove_arguments() {
        let Command::Masters(a) = parse(&["masters", "add", "4", "m4:7050", "--json"])
            .unwrap()
            .command
        else {
            panic!("not masters")
        };
        match a.command {
            Some(MastersCommand::Add { id, address, flags }) => {
                assert_eq!((id, address.as_str(), flags.json), (4, "m4:7050", true));
            }
            other => panic!("parsed as {other:?}"),
        }
        let Command::Masters(a) = parse(&["masters", "remove", "2"]).unwrap().command else {
            panic!("not masters")
        };
        assert!(matches!(
            a.command,
            Some(MastersCommand::Remove { id: 2, .. })
        ));
        let Command::Masters(a) = parse(&["masters", "--json"]).unwrap().command else {
            panic!("not masters")
        };
        assert!(a.command.is_none() && a.flags.json);

        for bad in [
            &["masters", "add", "0", "m4:7050"][..],
            &["masters", "add", "x", "m4:7050"],
            &["masters", "add", "4", "m4"],
            &["masters", "add", "4", "m4:0"],
            &["masters", "add", "4"],
            &["masters", "remove", "0"],
            &["masters", "remove", "-1"],
            &["masters", "remove"],
        ] {
            let err = parse(bad).unwrap_err();
            assert_eq!(err.exit_code(), i32::from(EXIT_USAGE), "{bad:?}");
        }
        let err = parse(&["masters", "add", "0", "m4:7050"]).unwrap_err();
        assert!(err.to_string().contains("master id"), "{err}");
        let err = parse(&["masters", "add", "4", "m4"]).unwrap_err();
        assert!(err.to_string().contains("HOST:PORT"), "{err}");
    }
}
