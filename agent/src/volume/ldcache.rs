//! A reader of glibc's `/etc/ld.so.cache` (the layouts of glibc's
//! `sysdeps/generic/dl-cache.h`). [`parse`] is PURE over bytes; [`read`]
//! adds the file. Every offset in the file is bounds-checked: a truncated
//! or corrupt cache is an error, never a panic.
//!
//! Three layouts exist:
//! - new (`glibc-ld.so.cache1.1`, the default since glibc 2.32): string
//!   offsets are relative to the start of the new header, which is the
//!   start of the file;
//! - old (`ld.so-1.7.0`): string offsets are relative to the string table
//!   that follows the old entries;
//! - compat: an old cache whose string table hides a complete new cache,
//!   starting at the end of the old entries rounded up to 8 bytes. Its new
//!   entries' offsets are relative to that new header. The loader prefers
//!   the new part, and so do we.

use std::ffi::OsStr;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// `CACHEMAGIC`.
const OLD_MAGIC: &[u8] = b"ld.so-1.7.0";
/// `CACHEMAGIC_VERSION_NEW`.
const NEW_MAGIC: &[u8] = b"glibc-ld.so.cache1.1";
/// `sizeof (struct cache_file)`: magic (11), padding (1), nlibs (4).
const OLD_HEADER: usize = 16;
/// `sizeof (struct file_entry)`: flags, key, value.
const OLD_ENTRY: usize = 12;
/// `sizeof (struct cache_file_new)`.
const NEW_HEADER: usize = 48;
/// `sizeof (struct file_entry_new)`: flags, key, value, osversion, hwcap.
const NEW_ENTRY: usize = 24;
/// Real caches are well under a megabyte; this stops a bogus file from
/// being read whole.
pub const MAX_SIZE: u64 = 64 << 20;

/// `FLAG_ELF_LIBC6`: an ELF library for glibc, which every modern entry is.
pub const FLAG_ELF_LIBC6: i32 = 0x0003;
/// The x86-64 ABI, in the second byte of `flags` (tests write entries).
#[cfg(test)]
pub const FLAG_X8664_LIB64: i32 = 0x0300;

/// An ELF file class: `e_ident[EI_CLASS]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ElfClass {
    Elf32,
    Elf64,
}

/// Which layout a cache file had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Old,
    New,
    /// Old entries with a new cache inside the string table; parsed as new.
    Compat,
}

/// One library in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub flags: i32,
    /// The name programs ask for: usually the soname (`libcuda.so.1`).
    pub key: String,
    /// The file, as an absolute path on the system the cache describes.
    pub value: PathBuf,
    /// The hardware capabilities the entry needs (new format only; entries
    /// from `glibc-hwcaps` subdirectories have bits here).
    pub hwcap: u64,
}

/// A parsed cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cache {
    pub format: Format,
    /// In file order, which is the loader's order of preference.
    pub entries: Vec<Entry>,
}

/// What is wrong with a cache's bytes. Offsets are from the start of the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("not an ld.so cache (no `ld.so-1.7.0` or `glibc-ld.so.cache1.1` magic)")]
    BadMagic,
    #[error("truncated: {what} needs bytes {start}..{end} but the file has {len}")]
    Truncated {
        what: &'static str,
        start: u64,
        end: u64,
        len: usize,
    },
    #[error("unknown byte order flag {0} in the new header")]
    ByteOrder(u8),
    #[error("entry {index}: {field} string at offset {offset} is past the end ({len} bytes)")]
    StringOutOfBounds {
        index: usize,
        field: &'static str,
        offset: u64,
        len: usize,
    },
    #[error("entry {index}: {field} string at offset {offset} has no terminating NUL")]
    Unterminated {
        index: usize,
        field: &'static str,
        offset: u64,
    },
}

/// Reading a cache file failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading ld.so cache {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("ld.so cache {path} is larger than {MAX_SIZE} bytes")]
    TooLarge { path: PathBuf },
    #[error("ld.so cache {path}: {source}")]
    Malformed { path: PathBuf, source: ParseError },
}

/// Reads and parses the cache at `path`.
pub fn read(path: &Path) -> Result<Cache, Error> {
    let io = |source| Error::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .map_err(io)?
        .take(MAX_SIZE + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > MAX_SIZE {
        return Err(Error::TooLarge {
            path: path.to_path_buf(),
        });
    }
    parse(&bytes).map_err(|source| Error::Malformed {
        path: path.to_path_buf(),
        source,
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endian {
    Little,
    Big,
}

const NATIVE: Endian = if cfg!(target_endian = "big") {
    Endian::Big
} else {
    Endian::Little
};

/// Bounds-checked reads from the cache bytes.
struct Bytes<'a>(&'a [u8]);

impl<'a> Bytes<'a> {
    fn range(&self, what: &'static str, start: usize, n: usize) -> Result<&'a [u8], ParseError> {
        let truncated = || ParseError::Truncated {
            what,
            start: start as u64,
            end: (start as u64).saturating_add(n as u64),
            len: self.0.len(),
        };
        let end = start.checked_add(n).ok_or_else(truncated)?;
        self.0.get(start..end).ok_or_else(truncated)
    }

    fn array<const N: usize>(&self, what: &'static str, at: usize) -> Result<[u8; N], ParseError> {
        let mut out = [0; N];
        out.copy_from_slice(self.range(what, at, N)?);
        Ok(out)
    }

    fn u32(&self, what: &'static str, at: usize, e: Endian) -> Result<u32, ParseError> {
        let b = self.array(what, at)?;
        Ok(match e {
            Endian::Little => u32::from_le_bytes(b),
            Endian::Big => u32::from_be_bytes(b),
        })
    }

    fn u64(&self, what: &'static str, at: usize, e: Endian) -> Result<u64, ParseError> {
        let b = self.array(what, at)?;
        Ok(match e {
            Endian::Little => u64::from_le_bytes(b),
            Endian::Big => u64::from_be_bytes(b),
        })
    }

    /// The NUL-terminated string at `base + offset`.
    fn cstr(
        &self,
        index: usize,
        field: &'static str,
        base: usize,
        offset: u32,
    ) -> Result<&'a [u8], ParseError> {
        let at = base as u64 + u64::from(offset);
        let rest = usize::try_from(at)
            .ok()
            .and_then(|at| self.0.get(at..))
            .filter(|rest| !rest.is_empty())
            .ok_or(ParseError::StringOutOfBounds {
                index,
                field,
                offset: at,
                len: self.0.len(),
            })?;
        let nul = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or(ParseError::Unterminated {
                index,
                field,
                offset: at,
            })?;
        Ok(&rest[..nul])
    }

    /// Checks that `n` records of `size` bytes fit at `start`, before
    /// anything is allocated for them; returns where they end.
    fn table(
        &self,
        what: &'static str,
        start: usize,
        n: u32,
        size: usize,
    ) -> Result<usize, ParseError> {
        let bytes = (n as usize).saturating_mul(size);
        self.range(what, start, bytes).map(|_| start + bytes)
    }
}

/// Parses a cache in any of the three layouts.
pub fn parse(data: &[u8]) -> Result<Cache, ParseError> {
    let b = Bytes(data);
    if data.starts_with(NEW_MAGIC) {
        return Ok(Cache {
            format: Format::New,
            entries: parse_new(&b, 0)?,
        });
    }
    if !data.starts_with(OLD_MAGIC) {
        let short = data.len() < NEW_MAGIC.len()
            && (NEW_MAGIC.starts_with(data) || OLD_MAGIC.starts_with(data));
        return Err(if short && !data.is_empty() {
            ParseError::Truncated {
                what: "magic",
                start: 0,
                end: OLD_MAGIC.len() as u64,
                len: data.len(),
            }
        } else {
            ParseError::BadMagic
        });
    }
    // The old header has no byte-order flag: it is the host's.
    let nlibs = b.u32("old header", OLD_MAGIC.len() + 1, NATIVE)?;
    let strings = b.table("old entries", OLD_HEADER, nlibs, OLD_ENTRY)?;
    // glibc aligns the new header to alignof(struct cache_file_new): 8 on
    // 64-bit hosts, 4 on 32-bit ones, where the unaligned end already is.
    let aligned = strings.next_multiple_of(8);
    for at in [aligned, strings] {
        if data
            .get(at..)
            .is_some_and(|rest| rest.starts_with(NEW_MAGIC))
        {
            return Ok(Cache {
                format: Format::Compat,
                entries: parse_new(&b, at)?,
            });
        }
    }
    let mut entries = Vec::with_capacity(nlibs as usize);
    for index in 0..nlibs as usize {
        let at = OLD_HEADER + index * OLD_ENTRY;
        let flags = b.u32("old entry", at, NATIVE)? as i32;
        let key = b.u32("old entry", at + 4, NATIVE)?;
        let value = b.u32("old entry", at + 8, NATIVE)?;
        entries.push(entry(&b, index, strings, flags, key, value, 0)?);
    }
    Ok(Cache {
        format: Format::Old,
        entries,
    })
}

/// The new-format cache whose header starts at `base`.
fn parse_new(b: &Bytes<'_>, base: usize) -> Result<Vec<Entry>, ParseError> {
    b.range("new header", base, NEW_HEADER)?;
    let [order] = b.array::<1>("new header", base + 28)?;
    let endian = match order & 3 {
        // Written by a glibc before 2.33, which did not record it.
        0 => NATIVE,
        2 => Endian::Little,
        3 => Endian::Big,
        other => return Err(ParseError::ByteOrder(other)),
    };
    let nlibs = b.u32("new header", base + 20, endian)?;
    let first = base + NEW_HEADER;
    b.table("new entries", first, nlibs, NEW_ENTRY)?;
    let mut entries = Vec::with_capacity(nlibs as usize);
    for index in 0..nlibs as usize {
        let at = first + index * NEW_ENTRY;
        let flags = b.u32("new entry", at, endian)? as i32;
        let key = b.u32("new entry", at + 4, endian)?;
        let value = b.u32("new entry", at + 8, endian)?;
        let hwcap = b.u64("new entry", at + 16, endian)?;
        entries.push(entry(b, index, base, flags, key, value, hwcap)?);
    }
    Ok(entries)
}

fn entry(
    b: &Bytes<'_>,
    index: usize,
    strings: usize,
    flags: i32,
    key: u32,
    value: u32,
    hwcap: u64,
) -> Result<Entry, ParseError> {
    // Sonames are ASCII; a stray byte should not cost the whole cache.
    let key = String::from_utf8_lossy(b.cstr(index, "key", strings, key)?).into_owned();
    let value = PathBuf::from(OsStr::from_bytes(b.cstr(index, "value", strings, value)?));
    Ok(Entry {
        flags,
        key,
        value,
        hwcap,
    })
}

/// Writes caches in each layout, for tests here and in `build`.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// A cache with entries `(flags, key, value)`.
    pub(crate) fn encode(format: Format, entries: &[(i32, &str, &str)]) -> Vec<u8> {
        encode_with(format, entries, Endian::Little)
    }

    pub(super) fn encode_with(format: Format, entries: &[(i32, &str, &str)], e: Endian) -> Vec<u8> {
        let u32b = |v: u32| match e {
            Endian::Little => v.to_le_bytes(),
            Endian::Big => v.to_be_bytes(),
        };
        // Strings: for each entry, key then value, offsets from the table start.
        let mut strings = Vec::new();
        let mut offsets = Vec::new();
        for (_, key, value) in entries {
            let k = strings.len() as u32;
            strings.extend_from_slice(key.as_bytes());
            strings.push(0);
            let v = strings.len() as u32;
            strings.extend_from_slice(value.as_bytes());
            strings.push(0);
            offsets.push((k, v));
        }
        let new = |out: &mut Vec<u8>| {
            let base = out.len();
            let table = (NEW_HEADER + entries.len() * NEW_ENTRY) as u32;
            out.extend_from_slice(NEW_MAGIC);
            out.extend_from_slice(&u32b(entries.len() as u32));
            out.extend_from_slice(&u32b(strings.len() as u32));
            out.push(if e == Endian::Little { 2 } else { 3 });
            out.extend_from_slice(&[0; 3 + 4 + 12]);
            assert_eq!(out.len() - base, NEW_HEADER);
            for ((flags, ..), (k, v)) in entries.iter().zip(&offsets) {
                out.extend_from_slice(&u32b(*flags as u32));
                out.extend_from_slice(&u32b(table + k));
                out.extend_from_slice(&u32b(table + v));
                out.extend_from_slice(&[0; 12]);
            }
            out.extend_from_slice(&strings);
        };
        let mut out = Vec::new();
        match format {
            Format::New => new(&mut out),
            Format::Old | Format::Compat => {
                out.extend_from_slice(OLD_MAGIC);
                out.push(0);
                out.extend_from_slice(&(entries.len() as u32).to_ne_bytes());
                let end = OLD_HEADER + entries.len() * OLD_ENTRY;
                // In compat, old offsets skip the padding and the new cache.
                let shift = match format {
                    Format::Compat => {
                        (end.next_multiple_of(8) - end + NEW_HEADER + entries.len() * NEW_ENTRY)
                            as u32
                    }
                    _ => 0,
                };
                for ((flags, ..), (k, v)) in entries.iter().zip(&offsets) {
                    out.extend_from_slice(&(*flags as u32).to_ne_bytes());
                    out.extend_from_slice(&(shift + k).to_ne_bytes());
                    out.extend_from_slice(&(shift + v).to_ne_bytes());
                }
                if format == Format::Compat {
                    out.resize(end.next_multiple_of(8), 0);
                    new(&mut out);
                } else {
                    out.extend_from_slice(&strings);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{encode, encode_with};
    use super::*;

    const X64: i32 = FLAG_ELF_LIBC6 | FLAG_X8664_LIB64;
    const ENTRIES: &[(i32, &str, &str)] = &[
        (
            X64,
            "libnvidia-ml.so.1",
            "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        ),
        (
            X64,
            "libcuda.so.1",
            "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        ),
        (
            FLAG_ELF_LIBC6,
            "libcuda.so.1",
            "/usr/lib/i386-linux-gnu/libcuda.so.1",
        ),
    ];

    fn keys(c: &Cache) -> Vec<(i32, &str, &str)> {
        c.entries
            .iter()
            .map(|e| (e.flags, e.key.as_str(), e.value.to_str().unwrap_or("?")))
            .collect()
    }

    #[test]
    fn every_layout_gives_the_same_entries() {
        // Three entries leave the compat layout 4 bytes of padding; two, none.
        for entries in [ENTRIES, &ENTRIES[..2], &ENTRIES[..1], &[]] {
            for format in [Format::New, Format::Old, Format::Compat] {
                let c = parse(&encode(format, entries)).unwrap();
                assert_eq!(c.format, format);
                assert_eq!(keys(&c), entries, "{format:?}");
            }
        }
        let be = parse(&encode_with(Format::New, ENTRIES, Endian::Big)).unwrap();
        assert_eq!(keys(&be), ENTRIES);
    }

    #[test]
    fn compat_layout_uses_the_new_part() {
        // Corrupt the old entries' offsets: the new part must still be read.
        let mut bytes = encode(Format::Compat, ENTRIES);
        for i in 0..ENTRIES.len() {
            let at = OLD_HEADER + i * OLD_ENTRY + 4;
            bytes[at..at + 8].copy_from_slice(&[0xff; 8]);
        }
        assert_eq!(keys(&parse(&bytes).unwrap()), ENTRIES);
    }

    #[test]
    fn reads_this_hosts_cache() {
        // Debian 12 writes the new layout; only check that it parses sanely.
        let path = Path::new("/etc/ld.so.cache");
        if !path.exists() {
            println!("skipped: no {}", path.display());
            return;
        }
        let c = read(path).unwrap();
        assert!(c.entries.iter().any(|e| e.key.starts_with("libc.so.")));
        assert!(c.entries.iter().all(|e| e.value.is_absolute()));
    }

    #[test]
    fn read_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");
        let e = read(&missing).unwrap_err();
        assert!(
            e.to_string().contains(&missing.display().to_string()),
            "{e}"
        );
        let garbage = dir.path().join("ld.so.cache");
        std::fs::write(&garbage, b"garbage garbage garbage").unwrap();
        let e = read(&garbage).unwrap_err();
        assert!(matches!(
            &e,
            Error::Malformed {
                source: ParseError::BadMagic,
                ..
            }
        ));
        assert!(
            e.to_string().contains(&garbage.display().to_string()),
            "{e}"
        );
    }

    #[test]
    fn every_truncation_is_an_error_or_the_whole_cache() {
        for format in [Format::New, Format::Old, Format::Compat] {
            let full = encode(format, ENTRIES);
            for n in 0..full.len() {
                match parse(&full[..n]) {
                    // Only a cut in the last string's bytes could pass: it cannot,
                    // since the final NUL is the file's last byte.
                    Ok(c) => panic!("{format:?} cut at {n} parsed: {c:?}"),
                    Err(e) => assert!(!e.to_string().is_empty()),
                }
            }
        }
        assert_eq!(parse(b""), Err(ParseError::BadMagic));
        assert!(matches!(
            parse(b"glibc-ld"),
            Err(ParseError::Truncated { .. })
        ));
    }

    #[test]
    fn garbage_and_hostile_headers_never_panic() {
        // A small LCG: deterministic noise without a dependency.
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut noise = |n: usize| {
            (0..n)
                .map(|_| {
                    seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    (seed >> 56) as u8
                })
                .collect::<Vec<u8>>()
        };
        for magic in [NEW_MAGIC, OLD_MAGIC, b"".as_slice()] {
            for len in [0, 1, 5, 20, 47, 48, 100, 1000] {
                for _ in 0..50 {
                    let mut bytes = magic.to_vec();
                    bytes.extend(noise(len));
                    let _ = parse(&bytes);
                }
            }
        }
        // Huge counts and offsets are refused before any allocation.
        let mut huge = encode(Format::New, ENTRIES);
        huge[20..24].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            parse(&huge),
            Err(ParseError::Truncated {
                what: "new entries",
                ..
            })
        ));
        let mut huge = encode(Format::Old, ENTRIES);
        huge[12..16].copy_from_slice(&u32::MAX.to_ne_bytes());
        assert!(matches!(
            parse(&huge),
            Err(ParseError::Truncated {
                what: "old entries",
                ..
            })
        ));
        let mut far = encode(Format::New, ENTRIES);
        far[NEW_HEADER + 4..NEW_HEADER + 8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            parse(&far),
            Err(ParseError::StringOutOfBounds {
                index: 0,
                field: "key",
                ..
            })
        ));
        let mut order = encode(Format::New, ENTRIES);
        order[28] = 1;
        assert_eq!(parse(&order), Err(ParseError::ByteOrder(1)));
    }
}
