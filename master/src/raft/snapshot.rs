//! Snapshots: the state's JSON, zstd-compressed (older plain ones still
//! read), and the state read back from a data directory at rest.

use raft::eraftpb::EntryType;

use super::storage::SledStorage;
use crate::state::{Command, State};

use super::types::*;

/// zstd's level for snapshots: its fastest; the state's JSON shrinks about
/// tenfold (jobs and agents repeat their field names and values), so a
/// snapshot is stored, kept and sent to a follower at a tenth of the size.
const SNAPSHOT_ZSTD_LEVEL: i32 = 1;
/// The first bytes of a zstd frame: a snapshot that starts with them is
/// compressed; older ones are plain JSON (they start with `{`).
pub(super) const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];

/// A snapshot of `state`: its JSON, compressed, and the JSON's size (what
/// the snapshot cadence compares the log with).
pub fn encode_snapshot(state: &State) -> Result<(Vec<u8>, usize), NodeError> {
    let json = serde_json::to_vec(state)?;
    let data =
        zstd::bulk::compress(&json, SNAPSHOT_ZSTD_LEVEL).map_err(NodeError::SnapshotCodec)?;
    Ok((data, json.len()))
}

/// The state a stopped master's data dir holds: its snapshot and every
/// entry of its log after it, applied (committed or not). For tools and
/// benchmarks; a master never reads its state this way.
pub fn state_at_rest(data_dir: &std::path::Path) -> Result<State, NodeError> {
    use raft::Storage as _;
    let storage = SledStorage::open(data_dir, &[])?;
    let (_, data) = storage.snapshot_data()?;
    let mut state = if data.is_empty() {
        State::new()
    } else {
        decode_snapshot(&data)?.0
    };
    let (first, last) = (storage.first_index()?, storage.last_index()?);
    if first <= last {
        let entries =
            storage.entries(first, last + 1, None, raft::GetEntriesContext::empty(false))?;
        for e in entries {
            if e.get_entry_type() == EntryType::EntryNormal && !e.data.is_empty() {
                if let Ok(cmd) = Command::decode(&e.data) {
                    let _ = state.apply(e.index, &cmd);
                }
            }
        }
    }
    Ok(state)
}

/// The state in a snapshot, compressed or (written by an older master)
/// plain JSON, and the JSON's size.
pub fn decode_snapshot(data: &[u8]) -> Result<(State, usize), NodeError> {
    if data.starts_with(&ZSTD_MAGIC) {
        let json = zstd::stream::decode_all(data).map_err(NodeError::SnapshotCodec)?;
        Ok((serde_json::from_slice(&json)?, json.len()))
    } else {
        Ok((serde_json::from_slice(data)?, data.len()))
    }
}
