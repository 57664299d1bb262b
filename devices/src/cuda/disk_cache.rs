//! The on-disk cache of compiled GPU images, so that a program's second run compiles nothing.
//!
//! Where: `BRAID_CUDA_CACHE` (a directory; `off` turns the disk cache off), else
//! `$XDG_CACHE_HOME/braid/cuda`, else `~/.cache/braid/cuda`, else `braid-cuda-UID` under the
//! temporary directory. The directory is created private (0700) and used only if it belongs to
//! this user and no one else may write to it (an image from it runs on the GPU in this
//! process). Deleting it, or any file in it, is always safe: entries are recompiled.
//!
//! An entry is one file, `KEY.rkyv`, `KEY` a 128-bit hash of the entry's key: the printed
//! source, the architecture, every NVRTC option, NVRTC's version, the driver's version and
//! braid's version. The file is an rkyv archive of a format number, the key's fields in full,
//! a checksum of the image and the image. Reading validates it with rkyv's bytecheck, then
//! compares every key field with the one asked for and the checksum with the image: a file that
//! is truncated, corrupt, of another format, or holds another key (a hash collision, or a file
//! copied over) is reported as [`Lookup::Rejected`] and never trusted; the caller compiles
//! again and overwrites it. Files are written under a temporary name and renamed into place,
//! so a reader never sees half a file. The cache is never pruned.
//!
//! Must never: trust an entry it has not validated, write anywhere but its directory, or fail
//! a compile because the disk failed (errors are returned for the caller to log).

use rkyv::rancor::Error as RkyvError;
use rkyv::util::AlignedVec;
use rkyv::{Archive, Deserialize, Serialize};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Bumped whenever the layout of [`Entry`] changes (older files are then rejected).
const FORMAT: u32 = 1;

/// Everything that determines a compiled image; stored whole in its entry.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
pub struct EntryKey {
    pub source: String,
    pub arch: String,
    pub options: Vec<String>,
    pub nvrtc_version: [i32; 2],
    pub driver_version: i32,
    pub braid_version: String,
}

#[derive(Archive, Serialize, Deserialize)]
struct Entry {
    format: u32,
    key: EntryKey,
    checksum: [u64; 2],
    image: Vec<u8>,
}

/// What a lookup found.
#[derive(Debug)]
pub enum Lookup {
    /// A valid entry for exactly this key: its image.
    Hit(Vec<u8>),
    /// No entry.
    Miss,
    /// A file that must not be trusted, and why.
    Rejected(String),
}

fn hash128(salt: u64, value: &impl Hash) -> [u64; 2] {
    let half = |s: u64| {
        let mut h = std::hash::DefaultHasher::new();
        (salt, s).hash(&mut h);
        value.hash(&mut h);
        h.finish()
    };
    [half(1), half(2)]
}

/// A cache directory (see the module docs).
#[derive(Clone, Debug)]
pub struct DiskCache {
    dir: PathBuf,
}

impl DiskCache {
    /// The directory the environment asks for (see the module docs); `None` when
    /// `BRAID_CUDA_CACHE=off`.
    pub fn default_dir() -> Option<PathBuf> {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        if let Some(dir) = var("BRAID_CUDA_CACHE") {
            return (dir.as_os_str() != "off").then_some(dir);
        }
        // SAFETY: geteuid has no preconditions and cannot fail.
        let uid = unsafe { libc::geteuid() };
        Some(
            var("XDG_CACHE_HOME")
                .map(|d| d.join("braid/cuda"))
                .or_else(|| var("HOME").map(|d| d.join(".cache/braid/cuda")))
                .unwrap_or_else(|| std::env::temp_dir().join(format!("braid-cuda-{uid}"))),
        )
    }

    /// Opens (creating it if missing) the cache in `dir`; `Err` says why it cannot be used.
    pub fn open(dir: impl Into<PathBuf>) -> Result<DiskCache, String> {
        let dir = dir.into();
        #[cfg(unix)]
        {
            use std::os::unix::fs::{DirBuilderExt, MetadataExt};
            let _ = std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir);
            let meta = std::fs::metadata(&dir).map_err(|e| format!("no CUDA kernel cache {}: {e}", dir.display()))?;
            // SAFETY: geteuid has no preconditions and cannot fail.
            let uid = unsafe { libc::geteuid() };
            if !meta.is_dir() || meta.uid() != uid || meta.mode() & 0o022 != 0 {
                return Err(format!(
                    "the CUDA kernel cache {} is not a directory of this user that only it may write to; not used",
                    dir.display()
                ));
            }
        }
        #[cfg(not(unix))]
        std::fs::create_dir_all(&dir).map_err(|e| format!("no CUDA kernel cache {}: {e}", dir.display()))?;
        Ok(DiskCache { dir })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of `key`'s entry.
    pub fn path(&self, key: &EntryKey) -> PathBuf {
        let [a, b] = hash128(0xB4A1D, key);
        self.dir.join(format!("{a:016x}{b:016x}.rkyv"))
    }

    /// The image stored for `key`, validated (see the module docs).
    pub fn load(&self, key: &EntryKey) -> Lookup {
        let path = self.path(key);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Lookup::Miss,
            Err(e) => return Lookup::Rejected(format!("cannot read {}: {e}", path.display())),
        };
        // rkyv reads archives in place, from memory aligned for its largest field.
        let mut aligned = AlignedVec::<16>::with_capacity(bytes.len());
        aligned.extend_from_slice(&bytes);
        let entry = match rkyv::access::<ArchivedEntry, RkyvError>(&aligned) {
            Ok(e) => e,
            Err(e) => return Lookup::Rejected(format!("{} is not a valid entry ({e})", path.display())),
        };
        if entry.format.to_native() != FORMAT {
            return Lookup::Rejected(format!("{} has format {}, not {FORMAT}", path.display(), entry.format));
        }
        match rkyv::deserialize::<EntryKey, RkyvError>(&entry.key) {
            Ok(stored) if &stored == key => {}
            Ok(_) => {
                return Lookup::Rejected(format!("{} holds another kernel's entry (its key differs)", path.display()));
            }
            Err(e) => return Lookup::Rejected(format!("{} has an unreadable key ({e})", path.display())),
        }
        let image = entry.image.as_slice().to_vec();
        let checksum = [entry.checksum[0].to_native(), entry.checksum[1].to_native()];
        if checksum != hash128(0xC4EC, &image) {
            return Lookup::Rejected(format!("{}: the image does not match its checksum", path.display()));
        }
        Lookup::Hit(image)
    }

    /// Stores `image` for `key`, atomically replacing any entry there.
    pub fn store(&self, key: &EntryKey, image: &[u8]) -> Result<(), String> {
        let entry = Entry {
            format: FORMAT,
            key: key.clone(),
            checksum: hash128(0xC4EC, &image.to_vec()),
            image: image.to_vec(),
        };
        let bytes = rkyv::to_bytes::<RkyvError>(&entry).map_err(|e| format!("cannot archive an entry: {e}"))?;
        let path = self.path(key);
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let tmp = path.with_extension(format!("tmp{}.{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed)));
        let written = std::fs::write(&tmp, &bytes).and_then(|()| std::fs::rename(&tmp, &path));
        written.map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            format!("cannot write {}: {e}", path.display())
        })
    }
}
