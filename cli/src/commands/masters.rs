//! `gpuctl masters`: the masters of the Raft group.

use std::io::Write;

use gpuctl_proto::pb;
use serde::Serialize;

use super::CliError;
use crate::client::Master;
use crate::output::{self, Table};

/// Items of `masters --json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MasterJson {
    pub id: u64,
    pub address: String,
    /// `leader`, `follower` or `candidate`.
    pub role: String,
    pub term: u64,
    pub commit_index: u64,
    pub applied_index: u64,
}

impl From<&pb::MasterInfo> for MasterJson {
    fn from(m: &pb::MasterInfo) -> Self {
        MasterJson {
            id: m.id,
            address: m.address.clone(),
            role: m.role.clone(),
            term: m.term,
            commit_index: m.commit_index,
            applied_index: m.applied_index,
        }
    }
}

pub fn masters_table(masters: &[pb::MasterInfo]) -> Table {
    let mut t = Table::new(&["ID", "ADDRESS", "ROLE", "TERM", "COMMIT", "APPLIED"]);
    for m in masters {
        t.row(vec![
            m.id.to_string(),
            m.address.clone(),
            m.role.clone(),
            m.term.to_string(),
            m.commit_index.to_string(),
            m.applied_index.to_string(),
        ]);
    }
    t
}

pub async fn list(master: &mut Master, json: bool, out: &mut dyn Write) -> Result<(), CliError> {
    let mut masters = master
        .client
        .list_masters(pb::ListMastersRequest {})
        .await
        .map_err(|s| CliError::rpc(master, s))?
        .into_inner()
        .masters;
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

    #[test]
    fn json_and_table_shapes() {
        let m = pb::MasterInfo {
            id: 1,
            address: "10.0.0.1:7050".into(),
            role: "leader".into(),
            term: 3,
            commit_index: 42,
            applied_index: 42,
            answered: true,
        };
        let v = serde_json::to_value(MasterJson::from(&m)).unwrap();
        assert_eq!(v["role"], "leader");
        assert_eq!(v["commit_index"], 42);
        assert_eq!(v["id"], 1);
        let t = masters_table(&[m]).render();
        assert!(t.starts_with("ID"), "{t}");
        assert!(t.contains("10.0.0.1:7050") && t.contains("leader"), "{t}");
    }
}
