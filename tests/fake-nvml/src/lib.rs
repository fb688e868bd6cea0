//! fake-nvml: a stand-in libnvidia-ml for tests and demos on machines without
//! a GPU.
//!
//! Built as a cdylib (`target/<profile>/libfake_nvml.so`) exporting the part
//! of NVML's C API that nvml-wrapper 0.13 calls for discovery, health and
//! events. The machine it pretends to be is a JSON file named by
//! `FAKE_NVML_CONFIG`, re-read on every call so a test can change the
//! machine (lose a GPU, raise an XID) while the agent runs. Schema and
//! semantics: `tests/fake-nvml/README.md`.
//!
//! Layout: `ffi` (C types, copied from nvml-wrapper-sys), `config` (the JSON),
//! `state` (init count, handles, the only code that touches caller memory,
//! the config write-back), `profiles` (built-in MIG profile tables),
//! `exports`, `events`, `mig` and `memlimits` (the `#[no_mangle]` functions).
//!
//! Unsafe code is confined to reading and writing caller pointers (the NVML
//! contract) and to the event-set box; each block says why it holds. No
//! function unwinds across the C boundary: every body runs under
//! `catch_unwind` and a panic is NVML_ERROR_UNKNOWN.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod config;
pub mod events;
pub mod exports;
pub mod ffi;
pub mod memlimits;
pub mod mig;
pub mod profiles;
mod state;

#[cfg(test)]
mod tests;
