//! `raft::Storage` on sled: the log, the hard state and the conf state of one
//! master, under `<data-dir>/raft`.
//!
//! The log since the snapshot is kept in memory ([`Meta::log`]): raft-rs
//! reads it constantly (entries to send, terms to compare), and sled's B-tree
//! is only written for durability and read at open. On disk, each `append`
//! is one key of the tree `log` (its first index, big-endian, so that sled's
//! order is log order) holding its entries: one sled insert per ready, not
//! one per entry, and a compaction removes a few keys, not every entry (a
//! sled insert or remove per entry was about a third of the CPU of three
//! masters placing jobs). Metadata lives in the tree `meta`; snapshots, tens
//! of MiB, are plain files in `<data-dir>/raft-snapshots` ([`SnapshotFiles`]:
//! sled copied each through its page cache, a twelfth of the CPU of a busy
//! leader at 10,000 agents, and kept old copies on disk). Writes are
//! buffered by sled until [`SledStorage::flush`], which the ready loop calls
//! before anything that depends on them (replying to a proposal, sending
//! persisted messages) happens.
//!
//! Older versions kept one entry per key in the tree `entries`; open moves
//! such a log into `log`. A version before that cannot read `log` (it
//! would see an empty log and stop): downgrades past this change are not
//! supported (docs/operations.md).

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use protobuf::Message as _;
use raft::eraftpb::{ConfState, Entry, HardState, Snapshot, SnapshotMetadata};
use raft::{GetEntriesContext, RaftState, Storage, StorageError};

const KEY_HARD_STATE: &[u8] = b"hard_state";
const KEY_CONF_STATE: &[u8] = b"conf_state";
const KEY_SNAPSHOT_META: &[u8] = b"snapshot_meta";
/// Where snapshots were kept before they got a tree of their own (read
/// once at open and moved).
const KEY_SNAPSHOT_DATA: &[u8] = b"snapshot_data";

#[derive(Debug, thiserror::Error)]
pub enum StorageInitError {
    #[error("open raft storage {path}: {source}")]
    Open { path: PathBuf, source: sled::Error },
    #[error("raft storage {path}: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("raft snapshots in {path}: {source}")]
    Snapshots {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Snapshot data, one file per snapshot (`<index, 20 digits>.snap`),
/// written whole and durable (a temporary file, fsync, rename, fsync of the
/// directory) before the metadata names it.
#[derive(Clone, Debug)]
struct SnapshotFiles {
    dir: PathBuf,
}

impl SnapshotFiles {
    fn open(dir: PathBuf) -> std::io::Result<SnapshotFiles> {
        std::fs::create_dir_all(&dir)?;
        Ok(SnapshotFiles { dir })
    }

    fn path(&self, index: u64) -> PathBuf {
        self.dir.join(format!("{index:020}.snap"))
    }

    fn write(&self, index: u64, data: &[u8]) -> std::io::Result<()> {
        use std::io::Write;
        let tmp = self.dir.join(format!(".{index:020}.tmp"));
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        std::fs::rename(&tmp, self.path(index))?;
        std::fs::File::open(&self.dir)?.sync_all()
    }

    fn read(&self, index: u64) -> std::io::Result<Option<Vec<u8>>> {
        match std::fs::read(self.path(index)) {
            Ok(d) => Ok(Some(d)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Indexes of the snapshot files there, in order.
    #[cfg(test)]
    fn indexes(&self) -> std::io::Result<Vec<u64>> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(&self.dir)? {
            let name = e?.file_name();
            let name = name.to_string_lossy();
            if let Some(i) = name.strip_suffix(".snap").and_then(|n| n.parse().ok()) {
                out.push(i);
            }
        }
        out.sort_unstable();
        Ok(out)
    }

    /// Removes the files (and leftover temporary files) older than `index`.
    fn forget_before(&self, index: u64) -> std::io::Result<()> {
        for e in std::fs::read_dir(&self.dir)? {
            let e = e?;
            let name = e.file_name();
            let name = name.to_string_lossy();
            let stem = name
                .strip_suffix(".snap")
                .or_else(|| name.strip_prefix('.').and_then(|n| n.strip_suffix(".tmp")));
            if stem
                .and_then(|n| n.parse::<u64>().ok())
                .is_some_and(|i| i < index)
            {
                std::fs::remove_file(e.path())?;
            }
        }
        Ok(())
    }
}

/// Cached copies of the metadata and the log, so that raft-rs's reads
/// (`entries`, `term`, `first_index`, `last_index`, called constantly) do
/// not hit sled.
#[derive(Debug, Default)]
struct Meta {
    hard_state: HardState,
    conf_state: ConfState,
    snapshot: SnapshotMetadata,
    last_index: u64,
    /// Every entry after the snapshot, in order: `log[0]` has index
    /// `snapshot.index + 1`, the last has `last_index`.
    log: VecDeque<Entry>,
    /// The keys of the tree `log`: the first index of each stored batch
    /// and its last. A batch may begin before the snapshot (its front is
    /// compacted); it is removed once all of it is.
    batches: BTreeMap<u64, u64>,
}

impl Meta {
    fn first_index(&self) -> u64 {
        self.snapshot.index + 1
    }

    fn get(&self, index: u64) -> Option<&Entry> {
        let at = index.checked_sub(self.first_index())?;
        self.log.get(usize::try_from(at).ok()?)
    }
}

/// A batch of entries as stored under one key: each entry's length (u32,
/// big-endian), then the entry (protobuf).
fn encode_batch(ents: &[Entry]) -> raft::Result<Vec<u8>> {
    let mut out = Vec::new();
    for e in ents {
        let bytes = e.write_to_bytes().map_err(store_err)?;
        let len = u32::try_from(bytes.len()).map_err(store_err)?;
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&bytes);
    }
    Ok(out)
}

fn decode_batch(mut b: &[u8]) -> Result<Vec<Entry>, String> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let (len, rest) = b
            .split_first_chunk::<4>()
            .ok_or("a batch ends inside an entry's length")?;
        let len = u32::from_be_bytes(*len) as usize;
        if rest.len() < len {
            return Err("a batch ends inside an entry".into());
        }
        let (e, rest) = rest.split_at(len);
        out.push(Entry::parse_from_bytes(e).map_err(|e| e.to_string())?);
        b = rest;
    }
    Ok(out)
}

/// Cheap to clone: the node's loop and the thread that stores a snapshot
/// share it (sled's trees are shared; the cached metadata is behind one
/// lock).
#[derive(Clone)]
pub struct SledStorage {
    db: sled::Db,
    /// The log's batches (one per append), by first index.
    log: sled::Tree,
    meta_tree: sled::Tree,
    /// Snapshot data by index (the one `Meta::snapshot` names; older ones
    /// are removed once a newer is durable).
    snapshots: SnapshotFiles,
    meta: std::sync::Arc<Mutex<Meta>>,
}

fn key(index: u64) -> [u8; 8] {
    index.to_be_bytes()
}

fn store_err(e: impl std::fmt::Display) -> raft::Error {
    // raft-rs has no variant for I/O errors of the application's store;
    // Other carries the message up to the ready loop, which stops the node.
    raft::Error::Store(StorageError::Other(e.to_string().into()))
}

/// Opens sled, waiting briefly while the file lock of a previous opener of
/// the same directory (in this process: its flusher thread ends
/// asynchronously after drop) is released.
fn open_db(path: &Path) -> sled::Result<sled::Db> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    loop {
        match sled::open(path) {
            Err(sled::Error::Io(e))
                if e.to_string().contains("could not acquire lock")
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

/// Where the storage is opened, for its errors.
struct Opening {
    path: PathBuf,
    snap_dir: PathBuf,
}

impl Opening {
    fn open_err(&self, source: sled::Error) -> StorageInitError {
        StorageInitError::Open {
            path: self.path.clone(),
            source,
        }
    }

    fn snap_err(&self, source: std::io::Error) -> StorageInitError {
        StorageInitError::Snapshots {
            path: self.snap_dir.clone(),
            source,
        }
    }

    fn corrupt(&self, what: &str, e: &dyn std::fmt::Display) -> StorageInitError {
        StorageInitError::Corrupt {
            path: self.path.clone(),
            reason: format!("{what}: {e}"),
        }
    }
}

/// The hard state, the snapshot's metadata and the configuration (`voters`
/// in a new storage, written now).
fn read_meta(
    meta_tree: &sled::Tree,
    voters: &[u64],
    at: &Opening,
) -> Result<Meta, StorageInitError> {
    let mut meta = Meta::default();
    if let Some(b) = meta_tree.get(KEY_HARD_STATE).map_err(|e| at.open_err(e))? {
        meta.hard_state =
            HardState::parse_from_bytes(&b).map_err(|e| at.corrupt("hard state", &e))?;
    }
    if let Some(b) = meta_tree
        .get(KEY_SNAPSHOT_META)
        .map_err(|e| at.open_err(e))?
    {
        meta.snapshot = SnapshotMetadata::parse_from_bytes(&b)
            .map_err(|e| at.corrupt("snapshot metadata", &e))?;
    }
    match meta_tree.get(KEY_CONF_STATE).map_err(|e| at.open_err(e))? {
        Some(b) => {
            meta.conf_state =
                ConfState::parse_from_bytes(&b).map_err(|e| at.corrupt("conf state", &e))?;
        }
        None => {
            let mut cs = ConfState::default();
            cs.set_voters(voters.to_vec());
            let bytes = cs
                .write_to_bytes()
                .map_err(|e| at.corrupt("conf state", &e))?;
            meta_tree
                .insert(KEY_CONF_STATE, bytes)
                .map_err(|e| at.open_err(e))?;
            meta.conf_state = cs;
        }
    }
    Ok(meta)
}

/// A log of one entry per key (older versions) becomes one batch.
fn migrate_entries_tree(
    db: &sled::Db,
    log: &sled::Tree,
    at: &Opening,
) -> Result<(), StorageInitError> {
    let legacy = db.open_tree("entries").map_err(|e| at.open_err(e))?;
    if legacy.is_empty() {
        return Ok(());
    }
    let mut ents = Vec::new();
    for kv in legacy.iter() {
        let (_, v) = kv.map_err(|e| at.open_err(e))?;
        ents.push(Entry::parse_from_bytes(&v).map_err(|e| at.corrupt("entry", &e))?);
    }
    if let Some(first) = ents.first() {
        let bytes = encode_batch(&ents).map_err(|e| at.corrupt("entry", &e))?;
        log.insert(key(first.index), bytes)
            .map_err(|e| at.open_err(e))?;
    }
    db.flush().map_err(|e| at.open_err(e))?;
    legacy.clear().map_err(|e| at.open_err(e))?;
    Ok(())
}

/// The log after the snapshot, into `meta`: each batch keyed by its first
/// index, the entries in order with no gap.
fn read_log(log: &sled::Tree, meta: &mut Meta, at: &Opening) -> Result<(), StorageInitError> {
    let mut next = meta.snapshot.index + 1;
    for kv in log.iter() {
        let (k, v) = kv.map_err(|e| at.open_err(e))?;
        let k: [u8; 8] = k
            .as_ref()
            .try_into()
            .map_err(|_| at.corrupt("log key", &"not 8 bytes"))?;
        let ents = decode_batch(&v).map_err(|e| at.corrupt("log batch", &e))?;
        let (Some(first), Some(last)) = (ents.first(), ents.last()) else {
            continue;
        };
        if first.index != u64::from_be_bytes(k) {
            return Err(at.corrupt("log batch", &"its key is not its first index"));
        }
        meta.batches.insert(first.index, last.index);
        for e in ents {
            if e.index < next {
                continue; // compacted
            }
            if e.index != next {
                return Err(at.corrupt("log", &format!("entry {} follows {}", e.index, next - 1)));
            }
            next += 1;
            meta.log.push_back(e);
        }
    }
    meta.last_index = next - 1;
    Ok(())
}

/// A snapshot kept where older versions kept it (the tree `snapshots`,
/// before that beside the hard state) moves to its file; a log compacted
/// behind a snapshot that is gone cannot be replayed (starting from an
/// empty state would serve a state without it).
fn migrate_snapshot(
    db: &sled::Db,
    meta_tree: &sled::Tree,
    snapshots: &SnapshotFiles,
    meta: &Meta,
    at: &Opening,
) -> Result<(), StorageInitError> {
    let in_tree = db.open_tree("snapshots").map_err(|e| at.open_err(e))?;
    if snapshots
        .read(meta.snapshot.index)
        .map_err(|e| at.snap_err(e))?
        .is_none()
    {
        let old = match in_tree
            .get(key(meta.snapshot.index))
            .map_err(|e| at.open_err(e))?
        {
            Some(d) => Some(d),
            None => meta_tree
                .get(KEY_SNAPSHOT_DATA)
                .map_err(|e| at.open_err(e))?,
        };
        if let Some(data) = old {
            snapshots
                .write(meta.snapshot.index, &data)
                .map_err(|e| at.snap_err(e))?;
        }
    }
    if meta.snapshot.index > 0
        && snapshots
            .read(meta.snapshot.index)
            .map_err(|e| at.snap_err(e))?
            .is_none()
    {
        return Err(at.corrupt(
            "snapshot",
            &format!(
                "the log starts after snapshot {} but {} is missing",
                meta.snapshot.index,
                snapshots.path(meta.snapshot.index).display()
            ),
        ));
    }
    if !in_tree.is_empty()
        || meta_tree
            .contains_key(KEY_SNAPSHOT_DATA)
            .map_err(|e| at.open_err(e))?
    {
        in_tree.clear().map_err(|e| at.open_err(e))?;
        meta_tree
            .remove(KEY_SNAPSHOT_DATA)
            .map_err(|e| at.open_err(e))?;
    }
    Ok(())
}

impl SledStorage {
    /// Opens (or creates) the storage in `dir`. A new storage is initialised
    /// with `voters` as its configuration; an existing one keeps its own.
    pub fn open(dir: &Path, voters: &[u64]) -> Result<SledStorage, StorageInitError> {
        let at = Opening {
            path: dir.join("raft"),
            snap_dir: dir.join("raft-snapshots"),
        };
        let db = open_db(&at.path).map_err(|e| at.open_err(e))?;
        let log = db.open_tree("log").map_err(|e| at.open_err(e))?;
        let meta_tree = db.open_tree("meta").map_err(|e| at.open_err(e))?;
        let snapshots = SnapshotFiles::open(at.snap_dir.clone()).map_err(|e| at.snap_err(e))?;
        let mut meta = read_meta(&meta_tree, voters, &at)?;
        migrate_entries_tree(&db, &log, &at)?;
        read_log(&log, &mut meta, &at)?;
        migrate_snapshot(&db, &meta_tree, &snapshots, &meta, &at)?;
        db.flush().map_err(|e| at.open_err(e))?;
        Ok(SledStorage {
            db,
            log,
            meta_tree,
            snapshots,
            meta: std::sync::Arc::new(Mutex::new(meta)),
        })
    }

    fn meta(&self) -> std::sync::MutexGuard<'_, Meta> {
        // A poisoned lock means a panic elsewhere; the data is still valid
        // (every update is a plain assignment), so keep going.
        self.meta.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends entries, first dropping any existing entries at or after the
    /// first new index (a new leader may overwrite an uncommitted suffix).
    pub fn append(&self, ents: &[Entry]) -> raft::Result<()> {
        let (Some(first), Some(last)) = (ents.first(), ents.last()) else {
            return Ok(());
        };
        let mut meta = self.meta();
        if first.index < meta.first_index() || first.index > meta.last_index + 1 {
            return Err(store_err(format!(
                "cannot append at {}: the log holds {} to {}",
                first.index,
                meta.first_index(),
                meta.last_index
            )));
        }
        let mut batch = sled::Batch::default();
        if first.index <= meta.last_index {
            // Batches from the first new index on go; the one it cuts keeps
            // its front (from the first entry not compacted).
            let cut: Vec<(u64, u64)> = meta
                .batches
                .iter()
                .filter(|(_, &l)| l >= first.index)
                .map(|(&f, &l)| (f, l))
                .collect();
            for (f, _) in &cut {
                batch.remove(&key(*f));
                meta.batches.remove(f);
            }
            let keep = (first.index - meta.first_index()) as usize;
            meta.log.truncate(keep);
            if let Some(&(f, _)) = cut.first().filter(|(f, _)| *f < first.index) {
                let from = f.max(meta.first_index());
                let front: Vec<Entry> = meta
                    .log
                    .iter()
                    .skip((from - meta.first_index()) as usize)
                    .cloned()
                    .collect();
                if !front.is_empty() {
                    batch.insert(&key(from), encode_batch(&front)?);
                    meta.batches.insert(from, first.index - 1);
                }
            }
        }
        batch.insert(&key(first.index), encode_batch(ents)?);
        self.log.apply_batch(batch).map_err(store_err)?;
        meta.batches.insert(first.index, last.index);
        meta.log.extend(ents.iter().cloned());
        meta.last_index = last.index;
        Ok(())
    }

    pub fn set_hard_state(&self, hs: &HardState) -> raft::Result<()> {
        self.meta_tree
            .insert(KEY_HARD_STATE, hs.write_to_bytes().map_err(store_err)?)
            .map_err(store_err)?;
        self.meta().hard_state = hs.clone();
        Ok(())
    }

    pub fn set_commit(&self, commit: u64) -> raft::Result<()> {
        let mut hs = self.meta().hard_state.clone();
        hs.set_commit(commit);
        self.set_hard_state(&hs)
    }

    pub fn set_conf_state(&self, cs: &ConfState) -> raft::Result<()> {
        self.meta_tree
            .insert(KEY_CONF_STATE, cs.write_to_bytes().map_err(store_err)?)
            .map_err(store_err)?;
        self.meta().conf_state = cs.clone();
        Ok(())
    }

    /// Makes everything written so far durable (fsync).
    pub fn flush(&self) -> raft::Result<()> {
        self.db.flush().map(|_| ()).map_err(store_err)
    }

    /// Records a snapshot of the state machine at `index` (whose entry has
    /// `term`) and drops the log up to it. Durable when this returns: the
    /// snapshot is flushed before any entry is removed.
    ///
    /// It may run on a thread of its own while the node's loop goes on
    /// appending and reading: the data (tens of MiB at 10,000 agents) is
    /// written and flushed without the metadata lock; the switch to the new
    /// snapshot is made under it, and only then are entries removed (a read
    /// that meets a removed entry answers `Compacted`, as raft-rs expects).
    /// A snapshot newer than `index` installed meanwhile wins.
    pub fn compact(&self, index: u64, term: u64, data: Vec<u8>) -> raft::Result<()> {
        let conf_state = {
            let meta = self.meta();
            if index <= meta.snapshot.index {
                return Ok(());
            }
            if index > meta.last_index {
                return Err(store_err(format!(
                    "cannot compact to {index}: the log ends at {}",
                    meta.last_index
                )));
            }
            meta.conf_state.clone()
        };
        let mut sm = SnapshotMetadata {
            index,
            term,
            ..Default::default()
        };
        sm.set_conf_state(conf_state);
        // The data first, durable, in its own file: until the metadata
        // names it, the snapshot before stays whole.
        self.snapshots.write(index, &data).map_err(store_err)?;
        let gone = {
            let mut meta = self.meta();
            if index <= meta.snapshot.index {
                return Ok(());
            }
            self.meta_tree
                .insert(KEY_SNAPSHOT_META, sm.write_to_bytes().map_err(store_err)?)
                .map_err(store_err)?;
            let drop = ((index - meta.snapshot.index) as usize).min(meta.log.len());
            meta.log.drain(..drop);
            meta.snapshot = sm;
            // Batches wholly compacted; one that straddles the snapshot
            // stays (open skips its front).
            let gone: Vec<u64> = meta
                .batches
                .iter()
                .filter(|(_, &l)| l <= index)
                .map(|(&f, _)| f)
                .collect();
            for f in &gone {
                meta.batches.remove(f);
            }
            gone
        };
        self.db.flush().map_err(store_err)?;
        self.forget_snapshots_before(index)?;
        let mut batch = sled::Batch::default();
        for f in gone {
            batch.remove(&key(f));
        }
        self.log.apply_batch(batch).map_err(store_err)?;
        Ok(())
    }

    /// Replaces the log with a snapshot received from the leader: the
    /// snapshot, its configuration and a hard state that commits it are
    /// durable when this returns.
    pub fn apply_snapshot(&self, snap: &Snapshot) -> raft::Result<()> {
        let mut meta = self.meta();
        let sm = snap.get_metadata();
        if sm.index <= meta.snapshot.index {
            return Err(raft::Error::Store(StorageError::SnapshotOutOfDate));
        }
        let mut hs = meta.hard_state.clone();
        hs.set_term(hs.term.max(sm.term));
        hs.set_commit(sm.index);
        self.snapshots
            .write(sm.index, &snap.data)
            .map_err(store_err)?;
        self.meta_tree
            .insert(KEY_SNAPSHOT_META, sm.write_to_bytes().map_err(store_err)?)
            .map_err(store_err)?;
        self.meta_tree
            .insert(
                KEY_CONF_STATE,
                sm.get_conf_state().write_to_bytes().map_err(store_err)?,
            )
            .map_err(store_err)?;
        self.meta_tree
            .insert(KEY_HARD_STATE, hs.write_to_bytes().map_err(store_err)?)
            .map_err(store_err)?;
        // Every entry is superseded: those before by the snapshot, those
        // after belong to a log that disagreed with the leader's.
        self.log.clear().map_err(store_err)?;
        self.db.flush().map_err(store_err)?;
        self.forget_snapshots_before(sm.index)?;
        meta.log.clear();
        meta.batches.clear();
        meta.last_index = sm.index;
        meta.conf_state = sm.get_conf_state().clone();
        meta.hard_state = hs;
        meta.snapshot = sm.clone();
        Ok(())
    }

    /// The latest snapshot's metadata and state-machine data (empty data:
    /// none yet).
    pub fn snapshot_data(&self) -> raft::Result<(SnapshotMetadata, Vec<u8>)> {
        let meta = self.meta().snapshot.clone();
        let data = self
            .snapshots
            .read(meta.index)
            .map_err(store_err)?
            .unwrap_or_default();
        Ok((meta, data))
    }

    /// Removes the snapshots older than the durable one at `index`.
    fn forget_snapshots_before(&self, index: u64) -> raft::Result<()> {
        self.snapshots.forget_before(index).map_err(store_err)
    }

    pub fn hard_state(&self) -> HardState {
        self.meta().hard_state.clone()
    }

    pub fn conf_state(&self) -> ConfState {
        self.meta().conf_state.clone()
    }
}

impl Storage for SledStorage {
    fn initial_state(&self) -> raft::Result<RaftState> {
        let meta = self.meta();
        Ok(RaftState::new(
            meta.hard_state.clone(),
            meta.conf_state.clone(),
        ))
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        let max_size = max_size.into();
        let meta = self.meta();
        if low < meta.first_index() {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > meta.last_index + 1 {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let mut out = Vec::with_capacity(high.saturating_sub(low) as usize);
        let mut size = 0u64;
        for i in low..high {
            let Some(e) = meta.get(i) else {
                return Err(store_err(format!("entry {i} missing from the log")));
            };
            size += u64::from(e.compute_size());
            // Always return at least one entry, as the trait requires.
            if !out.is_empty() && max_size.is_some_and(|m| size > m) {
                break;
            }
            out.push(e.clone());
        }
        Ok(out)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        let meta = self.meta();
        if idx == meta.snapshot.index {
            return Ok(meta.snapshot.term);
        }
        if idx < meta.first_index() {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if idx > meta.last_index {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        meta.get(idx)
            .map(|e| e.term)
            .ok_or_else(|| store_err(format!("entry {idx} missing from the log")))
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.meta().first_index())
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.meta().last_index)
    }

    fn snapshot(&self, _request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        // The latest compaction's (or installed) snapshot: a follower that
        // needs one lags behind the first entry still in the log, which is
        // always just after it.
        let (meta, data) = self.snapshot_data()?;
        if data.is_empty() {
            return Err(raft::Error::Store(
                StorageError::SnapshotTemporarilyUnavailable,
            ));
        }
        let mut snap = Snapshot {
            data: data.into(),
            ..Default::default()
        };
        snap.set_metadata(meta);
        Ok(snap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u64, term: u64) -> Entry {
        Entry {
            index,
            term,
            data: format!("e{index}").into_bytes().into(),
            ..Default::default()
        }
    }

    #[test]
    fn new_storage_has_initial_conf_state_and_empty_log() {
        let dir = tempfile::tempdir().unwrap();
        let s = SledStorage::open(dir.path(), &[1]).unwrap();
        let rs = s.initial_state().unwrap();
        assert_eq!(rs.conf_state.voters, vec![1]);
        assert_eq!(s.first_index().unwrap(), 1);
        assert_eq!(s.last_index().unwrap(), 0);
        assert_eq!(s.term(0).unwrap(), 0);
        assert!(matches!(
            s.term(1),
            Err(raft::Error::Store(StorageError::Unavailable))
        ));
    }

    #[test]
    fn append_truncates_conflicting_suffix_and_survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = SledStorage::open(dir.path(), &[1]).unwrap();
            s.append(&[entry(1, 1), entry(2, 1), entry(3, 1)]).unwrap();
            // A new leader overwrites from index 2.
            s.append(&[entry(2, 2)]).unwrap();
            assert_eq!(s.last_index().unwrap(), 2);
            assert_eq!(s.term(2).unwrap(), 2);
            let hs = HardState {
                term: 2,
                vote: 1,
                commit: 2,
                ..Default::default()
            };
            s.set_hard_state(&hs).unwrap();
            s.flush().unwrap();
        }
        let s = SledStorage::open(dir.path(), &[7]).unwrap();
        let rs = s.initial_state().unwrap();
        assert_eq!(rs.hard_state.commit, 2);
        assert_eq!(rs.hard_state.term, 2);
        // The stored configuration wins over the one given at open.
        assert_eq!(rs.conf_state.voters, vec![1]);
        assert_eq!(s.last_index().unwrap(), 2);
        let ents = s
            .entries(1, 3, None, GetEntriesContext::empty(false))
            .unwrap();
        assert_eq!(
            ents.iter().map(|e| (e.index, e.term)).collect::<Vec<_>>(),
            vec![(1, 1), (2, 2)]
        );
    }

    #[test]
    fn entries_respects_max_size_but_returns_at_least_one() {
        let dir = tempfile::tempdir().unwrap();
        let s = SledStorage::open(dir.path(), &[1]).unwrap();
        s.append(&[entry(1, 1), entry(2, 1), entry(3, 1)]).unwrap();
        let one = s
            .entries(1, 4, Some(1), GetEntriesContext::empty(false))
            .unwrap();
        assert_eq!(one.len(), 1);
        let all = s
            .entries(1, 4, Some(u64::MAX), GetEntriesContext::empty(false))
            .unwrap();
        assert_eq!(all.len(), 3);
        assert!(s
            .entries(1, 9, None, GetEntriesContext::empty(false))
            .is_err());
    }

    #[test]
    fn applying_a_leaders_snapshot_replaces_the_log_durably() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = SledStorage::open(dir.path(), &[]).unwrap();
            // A stale suffix from an old term, which the snapshot supersedes.
            s.append(&[entry(1, 1), entry(2, 1)]).unwrap();
            let mut sm = SnapshotMetadata {
                index: 9,
                term: 3,
                ..Default::default()
            };
            let mut cs = ConfState::default();
            cs.set_voters(vec![1, 2, 3]);
            sm.set_conf_state(cs);
            let mut snap = Snapshot {
                data: b"state@9".to_vec().into(),
                ..Default::default()
            };
            snap.set_metadata(sm);
            s.apply_snapshot(&snap).unwrap();
            assert_eq!(s.first_index().unwrap(), 10);
            assert_eq!(s.last_index().unwrap(), 9);
            assert_eq!(s.term(9).unwrap(), 3);
            // An older one is refused.
            let mut old = snap.clone();
            old.mut_metadata().index = 5;
            assert!(s.apply_snapshot(&old).is_err());
        }
        let s = SledStorage::open(dir.path(), &[]).unwrap();
        let rs = s.initial_state().unwrap();
        assert_eq!(rs.conf_state.voters, vec![1, 2, 3]);
        assert_eq!((rs.hard_state.commit, rs.hard_state.term), (9, 3));
        assert_eq!(s.snapshot_data().unwrap().1, b"state@9");
        assert_eq!(s.last_index().unwrap(), 9);
    }

    #[test]
    fn snapshots_live_apart_from_the_hard_state_and_old_layouts_move() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = SledStorage::open(dir.path(), &[1]).unwrap();
            s.append(&[entry(1, 1), entry(2, 1), entry(3, 1)]).unwrap();
            s.compact(2, 1, b"state@2".to_vec()).unwrap();
            s.compact(3, 1, b"state@3".to_vec()).unwrap();
            // Only the latest is kept, in its own file.
            assert_eq!(s.snapshots.indexes().unwrap(), vec![3]);
            assert!(s.meta_tree.get(KEY_SNAPSHOT_DATA).unwrap().is_none());
            // The oldest layout: the snapshot beside the hard state.
            s.meta_tree
                .insert(KEY_SNAPSHOT_DATA, b"legacy@3".to_vec())
                .unwrap();
            std::fs::remove_file(s.snapshots.path(3)).unwrap();
            s.flush().unwrap();
        }
        let s = SledStorage::open(dir.path(), &[1]).unwrap();
        assert_eq!(s.snapshot_data().unwrap().1, b"legacy@3");
        assert!(
            s.meta_tree.get(KEY_SNAPSHOT_DATA).unwrap().is_none(),
            "moved"
        );
        assert_eq!(s.snapshot(3, 1).unwrap().get_metadata().index, 3);
        // The layout before files: a tree of snapshots by index.
        s.db.open_tree("snapshots")
            .unwrap()
            .insert(key(3), b"tree@3".to_vec())
            .unwrap();
        std::fs::remove_file(s.snapshots.path(3)).unwrap();
        s.flush().unwrap();
        drop(s);
        let s = SledStorage::open(dir.path(), &[1]).unwrap();
        assert_eq!(s.snapshot_data().unwrap().1, b"tree@3");
        assert!(s.db.open_tree("snapshots").unwrap().is_empty(), "moved");
        // A temporary file left by a crash mid-write is not a snapshot, and
        // goes with the next compaction.
        std::fs::write(s.snapshots.dir.join(format!(".{:020}.tmp", 3)), b"torn").unwrap();
        assert_eq!(s.snapshots.indexes().unwrap(), vec![3]);
    }

    #[test]
    fn compaction_on_another_thread_leaves_reads_whole_or_compacted() {
        let dir = tempfile::tempdir().unwrap();
        let s = SledStorage::open(dir.path(), &[1]).unwrap();
        let all: Vec<Entry> = (1..=2000).map(|i| entry(i, 1)).collect();
        s.append(&all).unwrap();
        let other = s.clone();
        let compacting = std::thread::spawn(move || {
            for at in (100..=1500).step_by(100) {
                other.compact(at, 1, vec![7; 1 << 16]).unwrap();
            }
        });
        // Meanwhile the loop reads as raft-rs does: each read is whole, or
        // says the entries are compacted.
        let mut compacted = 0;
        while !compacting.is_finished() {
            match s.entries(50, 1900, None, GetEntriesContext::empty(false)) {
                Ok(got) => assert_eq!(got.len(), 1850),
                Err(raft::Error::Store(StorageError::Compacted)) => compacted += 1,
                Err(e) => panic!("read during a compaction: {e}"),
            }
            match s.term(1200) {
                Ok(t) => assert_eq!(t, 1),
                Err(raft::Error::Store(StorageError::Compacted)) => {}
                Err(e) => panic!("term during a compaction: {e}"),
            }
        }
        compacting.join().unwrap();
        // (How many reads met a compaction depends on the threads' timing.)
        let _ = compacted;
        assert_eq!(s.first_index().unwrap(), 1501);
        assert_eq!(s.term(1500).unwrap(), 1, "the snapshot's term");
        assert_eq!(
            s.snapshots.indexes().unwrap(),
            vec![1500],
            "older snapshots removed"
        );
        s.append(&[entry(2001, 2)]).unwrap();
        assert_eq!(
            s.entries(1501, 2002, None, GetEntriesContext::empty(false))
                .unwrap()
                .len(),
            501
        );
    }

    #[test]
    fn compaction_keeps_a_snapshot_and_drops_the_log_before_it() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = SledStorage::open(dir.path(), &[1]).unwrap();
            s.append(&[entry(1, 1), entry(2, 1), entry(3, 2), entry(4, 2)])
                .unwrap();
            s.compact(3, 2, b"state@3".to_vec()).unwrap();
            assert_eq!(s.first_index().unwrap(), 4);
            assert_eq!(s.last_index().unwrap(), 4);
            assert_eq!(s.term(3).unwrap(), 2, "the snapshot's term is kept");
            assert!(matches!(
                s.entries(2, 4, None, GetEntriesContext::empty(false)),
                Err(raft::Error::Store(StorageError::Compacted))
            ));
            // Compacting backwards or past the log does nothing / fails.
            s.compact(2, 1, b"old".to_vec()).unwrap();
            assert!(s.compact(9, 2, b"x".to_vec()).is_err());
            let snap = s.snapshot(3, 2).unwrap();
            assert_eq!(snap.get_metadata().index, 3);
            assert_eq!(&snap.data[..], b"state@3");
        }
        let s = SledStorage::open(dir.path(), &[1]).unwrap();
        assert_eq!(s.first_index().unwrap(), 4);
        let (meta, data) = s.snapshot_data().unwrap();
        assert_eq!((meta.index, meta.term), (3, 2));
        assert_eq!(data, b"state@3");
        let ents = s
            .entries(4, 5, None, GetEntriesContext::empty(false))
            .unwrap();
        assert_eq!(ents[0].index, 4);
    }

    /// The log as raft-rs sees it, read back whole.
    fn read_all(s: &SledStorage) -> Vec<(u64, u64, Vec<u8>)> {
        let (first, last) = (s.first_index().unwrap(), s.last_index().unwrap());
        s.entries(first, last + 1, None, GetEntriesContext::empty(false))
            .unwrap()
            .into_iter()
            .map(|e| (e.index, e.term, e.data.to_vec()))
            .collect()
    }

    /// Appends (some overwriting a suffix, some cutting a stored batch),
    /// compactions (some straddling a batch) and reopens in any order: the
    /// log read back, live and after a reopen, is always the model's, and
    /// the tree holds one key per batch, not one per entry.
    #[test]
    fn the_log_in_batches_matches_a_model_through_overwrites_compactions_and_reopens() {
        use proptest::prelude::*;
        use proptest::test_runner::{Config, TestRunner};
        #[derive(Debug, Clone)]
        enum Op {
            /// Append `n` entries from `back` entries before the end.
            Append {
                back: u64,
                n: u64,
            },
            /// Compact at a fraction of the log, in 1/8ths.
            Compact(u64),
            Reopen,
        }
        let op = prop_oneof![
            4 => (0u64..6, 1u64..9).prop_map(|(back, n)| Op::Append { back, n }),
            1 => (0u64..9).prop_map(Op::Compact),
            1 => Just(Op::Reopen),
        ];
        let mut runner = TestRunner::new(Config {
            cases: 64,
            ..Config::default()
        });
        runner
            .run(&proptest::collection::vec(op, 1..40), |ops| {
                let dir = tempfile::tempdir().unwrap();
                let mut s = SledStorage::open(dir.path(), &[1]).unwrap();
                // The model: the snapshot's index and the entries after it.
                let (mut snap, mut model): (u64, Vec<(u64, u64, Vec<u8>)>) = (0, Vec::new());
                let mut term = 1;
                for op in ops {
                    match op {
                        Op::Append { back, n } => {
                            let last = snap + model.len() as u64;
                            let from = (last + 1).saturating_sub(back).max(snap + 1);
                            term += 1;
                            let ents: Vec<Entry> = (from..from + n)
                                .map(|i| Entry {
                                    index: i,
                                    term,
                                    data: format!("{i}@{term}").into_bytes().into(),
                                    ..Default::default()
                                })
                                .collect();
                            s.append(&ents).unwrap();
                            model.truncate((from - snap - 1) as usize);
                            model.extend(ents.iter().map(|e| (e.index, e.term, e.data.to_vec())));
                        }
                        Op::Compact(eighths) => {
                            let at = snap + model.len() as u64 * eighths / 8;
                            if at > snap {
                                let t = model[(at - snap - 1) as usize].1;
                                s.compact(at, t, format!("state@{at}").into_bytes())
                                    .unwrap();
                                model.drain(..(at - snap) as usize);
                                snap = at;
                            }
                        }
                        Op::Reopen => {
                            s.flush().unwrap();
                            drop(s);
                            s = SledStorage::open(dir.path(), &[1]).unwrap();
                        }
                    }
                    prop_assert_eq!(s.first_index().unwrap(), snap + 1);
                    prop_assert_eq!(read_all(&s), model.clone());
                    prop_assert_eq!(s.log.len(), s.meta().batches.len());
                }
                s.flush().unwrap();
                drop(s);
                let s = SledStorage::open(dir.path(), &[1]).unwrap();
                prop_assert_eq!(read_all(&s), model);
                Ok(())
            })
            .unwrap();
    }

    /// A data dir of an older version (one entry per key in `entries`) is
    /// read, and moved into batches once.
    #[test]
    fn a_log_of_one_entry_per_key_moves_into_batches() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = SledStorage::open(dir.path(), &[1]).unwrap();
            let legacy = s.db.open_tree("entries").unwrap();
            for i in 1..=5 {
                legacy
                    .insert(key(i), entry(i, 1).write_to_bytes().unwrap())
                    .unwrap();
            }
            s.flush().unwrap();
        }
        let s = SledStorage::open(dir.path(), &[1]).unwrap();
        assert_eq!(s.last_index().unwrap(), 5);
        assert_eq!(read_all(&s).len(), 5);
        assert_eq!(read_all(&s)[4].2, b"e5");
        assert!(s.db.open_tree("entries").unwrap().is_empty());
        assert_eq!(s.log.len(), 1, "one batch");
        s.append(&[entry(6, 2)]).unwrap();
        drop(s);
        let s = SledStorage::open(dir.path(), &[1]).unwrap();
        assert_eq!(read_all(&s).len(), 6);
    }

    /// A snapshot file that is gone (deleted by hand, a disk lost) stops
    /// the master at open, naming it, instead of starting from an empty
    /// state with the log compacted behind it.
    #[test]
    fn a_missing_snapshot_file_is_refused_at_open() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = SledStorage::open(dir.path(), &[1]).unwrap();
            s.append(&[entry(1, 1), entry(2, 1), entry(3, 1)]).unwrap();
            s.compact(2, 1, b"state@2".to_vec()).unwrap();
            s.flush().unwrap();
            std::fs::remove_file(s.snapshots.path(2)).unwrap();
        }
        let err = SledStorage::open(dir.path(), &[1])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("snapshot 2") && err.contains(".snap"), "{err}");
    }
}
