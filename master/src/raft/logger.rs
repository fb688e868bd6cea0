//! raft-rs logs through slog; forward its records to `tracing`.

use std::fmt::Write as _;

use slog::{Drain, Key, OwnedKVList, Record, KV};

struct KvString(String);

impl slog::Serializer for KvString {
    fn emit_arguments(&mut self, key: Key, val: &std::fmt::Arguments) -> slog::Result {
        let _ = write!(self.0, " {key}={val}");
        Ok(())
    }
}

struct TracingDrain;

impl Drain for TracingDrain {
    type Ok = ();
    type Err = slog::Never;

    fn log(&self, record: &Record, values: &OwnedKVList) -> Result<(), slog::Never> {
        let mut kv = KvString(String::new());
        let _ = record.kv().serialize(record, &mut kv);
        let _ = values.serialize(record, &mut kv);
        let msg = record.msg();
        let kv = kv.0;
        match record.level() {
            slog::Level::Critical | slog::Level::Error => {
                tracing::error!(target: "raft", "{msg}{kv}")
            }
            slog::Level::Warning => tracing::warn!(target: "raft", "{msg}{kv}"),
            // raft-rs logs elections and role changes at info: useful, but
            // below the daemon's default level.
            slog::Level::Info => tracing::debug!(target: "raft", "{msg}{kv}"),
            _ => tracing::trace!(target: "raft", "{msg}{kv}"),
        }
        Ok(())
    }
}

pub fn logger(node_id: u64) -> slog::Logger {
    slog::Logger::root(TracingDrain.fuse(), slog::o!("raft_id" => node_id))
}
