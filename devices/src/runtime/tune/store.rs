//! The tuner's file: one per device, `autotune-HASH.rkyv` in the device's kernel cache
//! directory (`HASH` of the device's name and driver), an rkyv archive of a format number, the
//! device string in full, the choices and a checksum of them.
//!
//! Reading validates the archive (rkyv's bytecheck), the format, the device string (a file
//! copied from another machine, or a hash collision, is foreign) and the checksum; a file that
//! fails any of these is reported and never trusted. Writing reads the file again, adds every
//! choice another process stored meanwhile that this one lacks, and writes the whole under a
//! temporary name that is then renamed into place: a reader never sees half a file, and of two
//! processes writing at once the last rename wins with a valid file (the other's new choices
//! are timed again by whoever lacks them: harmless).
//!
//! Must never: trust a file it has not validated, or write anywhere but its directory.

use super::TuneKey;
use rkyv::rancor::BoxedError;
use rkyv::util::AlignedVec;
use rkyv::{Archive, Deserialize, Serialize};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Bumped whenever the layout of [`TuneFile`] changes (older files are then rejected).
pub const FORMAT: u32 = 1;

/// One kept choice.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
pub struct StoredChoice {
    pub key: TuneKey,
    /// [`super::checksum`] of the variants it was chosen among (those timed).
    pub checksum: u64,
    /// The chosen variant's name.
    pub variant: String,
    pub bitwise: bool,
    /// The times it was chosen over.
    pub why: String,
}

/// The file's contents.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct TuneFile {
    pub format: u32,
    pub device: String,
    pub choices: Vec<StoredChoice>,
    /// A hash of `device` and `choices`.
    pub checksum: u64,
}

fn sum(device: &str, choices: &[StoredChoice]) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    (0xA7u8, device, choices).hash(&mut h);
    h.finish()
}

impl TuneFile {
    /// A file of `choices` for `device`.
    pub fn new(device: &str, choices: Vec<StoredChoice>) -> TuneFile {
        TuneFile { format: FORMAT, device: device.into(), checksum: sum(device, &choices), choices }
    }

    /// The archive's bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, String> {
        rkyv::to_bytes::<BoxedError>(self).map(|b| b.to_vec()).map_err(|e| format!("cannot archive choices: {e}"))
    }

    /// Reads and validates an archive of `device`'s choices.
    pub fn from_bytes(bytes: &[u8], device: &str) -> Result<TuneFile, String> {
        let file = TuneFile::read(bytes)?;
        if file.device != device {
            return Err(format!("the choices of another device ({:?})", file.device));
        }
        Ok(file)
    }

    /// Reads and validates an archive of any device's choices.
    pub fn read(bytes: &[u8]) -> Result<TuneFile, String> {
        // rkyv reads archives in place, from memory aligned for its largest field.
        let mut aligned = AlignedVec::<16>::with_capacity(bytes.len());
        aligned.extend_from_slice(bytes);
        let file = rkyv::from_bytes::<TuneFile, BoxedError>(&aligned).map_err(|e| format!("not a valid file ({e})"))?;
        if file.format != FORMAT {
            return Err(format!("format {}, not {FORMAT}", file.format));
        }
        if file.checksum != sum(&file.device, &file.choices) {
            return Err("the choices do not match their checksum".into());
        }
        Ok(file)
    }
}

/// A device's file.
pub struct Store {
    path: PathBuf,
    device: String,
}

impl Store {
    /// The file of `device` in `dir`.
    pub fn new(dir: &Path, device: &str) -> Store {
        let hash = super::content_hash(&(0x7u8, device));
        Store { path: dir.join(format!("autotune-{hash:016x}.rkyv")), device: device.into() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's choices; `Ok(None)` when there is no file; `Err` says why a file is not used.
    pub fn load(&self) -> Result<Option<TuneFile>, String> {
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot read the tuning file {}: {e}", self.path.display())),
        };
        TuneFile::from_bytes(&bytes, &self.device)
            .map(Some)
            .map_err(|why| format!("the tuning file {} is not used: {why}", self.path.display()))
    }

    /// Writes `ours`, with the choices the file holds now for keys `ours` lacks.
    pub fn write(&self, mut ours: Vec<StoredChoice>) -> Result<(), String> {
        if let Ok(Some(theirs)) = self.load() {
            let known: hashbrown::HashSet<TuneKey> = ours.iter().map(|c| c.key.clone()).collect();
            ours.extend(theirs.choices.into_iter().filter(|c| !known.contains(&c.key)));
        }
        // A stable order, so that equal choices make equal files.
        ours.sort_by(|a, b| {
            (a.key.kernel, &a.key.shape, &a.key.dtypes).cmp(&(b.key.kernel, &b.key.shape, &b.key.dtypes))
        });
        let bytes = TuneFile::new(&self.device, ours).to_bytes()?;
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let tmp =
            self.path.with_extension(format!("tmp{}.{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed)));
        let written = std::fs::write(&tmp, &bytes).and_then(|()| std::fs::rename(&tmp, &self.path));
        written.map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            format!("cannot write the tuning file {}: {e}", self.path.display())
        })
    }
}
