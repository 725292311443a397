//! A slice's bytes on this node: checked against the coordinator's manifest, fetched where missing
//! or wrong, cached for the next start.
//!
//! Where the bytes come from, in order:
//! 1. a full copy of the model in `--models-dir` (same file name and size) whose ranges for this
//!    slice all match their sha256;
//! 2. the cache `--models-dir/<model id>/<file>`: a sparse copy of each model file, full size,
//!    holding only the ranges this node ever needed; every range is verified on every load, and
//!    a range that does not match (never fetched, truncated, a flipped byte) is fetched again.
//!
//! Only the ranges of the slice (headers, small whole files, the slice's own tensors) are read
//! or fetched, so a node with layers 10–19 of a 40 GB model moves a quarter of it. Fetched bytes
//! are verified before they are written; a range whose fetched bytes do not match is fetched
//! again (a few times), never loaded.

use crate::WorkerError;
use brigade_proto::v1::{FileRange, SliceManifest};
use sha2::{Digest, Sha256};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Fetch attempts per range before the load fails.
const ATTEMPTS: usize = 3;
/// A single range larger than this is refused (no tensor of a supported model comes near it).
const MAX_RANGE: u64 = 16 << 30;

/// What [`ensure_slice`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FetchReport {
    /// Where to open the model: a GGUF file or a directory.
    pub path: PathBuf,
    pub fetched_bytes: u64,
    pub fetched_ranges: usize,
    /// Ranges that were present but wrong (corrupt cache) and were fetched again.
    pub repaired_ranges: usize,
    pub verified_bytes: u64,
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// A file name from a manifest, made safe to join onto a directory: one plain path component.
fn safe_component(name: &str) -> Result<&str, WorkerError> {
    let ok = !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && !name.contains(['/', '\\', '\0'])
        && name != "..";
    if ok {
        Ok(name)
    } else {
        Err(WorkerError::Manifest(format!("file name `{name}` is not a plain file name")))
    }
}

fn check_manifest(m: &SliceManifest) -> Result<(), WorkerError> {
    safe_component(&m.model_id)?;
    if m.files.is_empty() {
        return Err(WorkerError::Manifest(format!("model {} lists no files", m.model_id)));
    }
    for f in &m.files {
        safe_component(&f.path)?;
    }
    for r in &m.ranges {
        let file = m
            .files
            .iter()
            .find(|f| f.path == r.file)
            .ok_or_else(|| WorkerError::Manifest(format!("range of `{}` names no listed file", r.file)))?;
        let end = r.offset.checked_add(r.length);
        if r.length > MAX_RANGE || end.is_none_or(|e| e > file.size) {
            return Err(WorkerError::Manifest(format!(
                "range {}+{} of `{}` lies outside its {} bytes",
                r.offset, r.length, r.file, file.size
            )));
        }
        if r.sha256.len() != 64 || !r.sha256.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(WorkerError::Manifest(format!(
                "range {}+{} of `{}` has no sha256",
                r.offset, r.length, r.file
            )));
        }
    }
    Ok(())
}

fn read_range(f: &File, r: &FileRange) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0u8; r.length as usize];
    f.read_exact_at(&mut buf, r.offset)?;
    Ok(buf)
}

fn matches(f: &File, r: &FileRange) -> bool {
    read_range(f, r).map(|b| sha256_hex(&b).eq_ignore_ascii_case(&r.sha256)).unwrap_or(false)
}

/// A full copy of a single-file model in `models_dir` that matches every range of the slice.
fn full_copy(models_dir: &Path, m: &SliceManifest) -> Option<PathBuf> {
    let [file] = m.files.as_slice() else { return None };
    let p = models_dir.join(&file.path);
    let f = File::open(&p).ok()?;
    if f.metadata().ok()?.len() != file.size {
        return None;
    }
    m.ranges.iter().all(|r| matches(&f, r)).then_some(p)
}

/// Makes sure this node holds every range of the slice in `m`, fetching with `fetch(range)` what
/// is missing or wrong, and says where to open the model.
pub fn ensure_slice(
    models_dir: &Path,
    m: &SliceManifest,
    mut fetch: impl FnMut(&FileRange) -> Result<Vec<u8>, WorkerError>,
) -> Result<FetchReport, WorkerError> {
    check_manifest(m)?;
    let verified: u64 = m.ranges.iter().map(|r| r.length).sum();
    if let Some(path) = full_copy(models_dir, m) {
        tracing::info!(path = %path.display(), "slice found in a full copy of the model");
        return Ok(FetchReport { path, verified_bytes: verified, ..Default::default() });
    }
    let dir = models_dir.join(&m.model_id);
    std::fs::create_dir_all(&dir).map_err(|e| WorkerError::io(&dir, e))?;
    let mut report = FetchReport { verified_bytes: verified, ..Default::default() };
    for file in &m.files {
        let p = dir.join(&file.path);
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&p)
            .map_err(|e| WorkerError::io(&p, e))?;
        let len = f.metadata().map_err(|e| WorkerError::io(&p, e))?.len();
        if len != file.size {
            // a sparse file of the full size: offsets are the model's own
            f.set_len(file.size).map_err(|e| WorkerError::io(&p, e))?;
        }
        for r in m.ranges.iter().filter(|r| r.file == file.path) {
            if matches(&f, r) {
                continue;
            }
            let present = read_range(&f, r).map(|b| b.iter().any(|&x| x != 0)).unwrap_or(false);
            let mut last = String::new();
            let mut done = false;
            for attempt in 1..=ATTEMPTS {
                let bytes = match fetch(r) {
                    Ok(b) => b,
                    Err(e) => {
                        last = e.to_string();
                        tracing::warn!(file = %r.file, offset = r.offset, attempt, "fetch failed: {e}");
                        continue;
                    }
                };
                report.fetched_bytes += bytes.len() as u64;
                if bytes.len() as u64 != r.length || !sha256_hex(&bytes).eq_ignore_ascii_case(&r.sha256) {
                    last = format!("got {} bytes that do not match sha256 {}", bytes.len(), r.sha256);
                    tracing::warn!(file = %r.file, offset = r.offset, attempt, "{last}");
                    continue;
                }
                f.write_all_at(&bytes, r.offset).map_err(|e| WorkerError::io(&p, e))?;
                report.fetched_ranges += 1;
                if present {
                    report.repaired_ranges += 1;
                    tracing::warn!(file = %r.file, tensor = %r.tensor, "cached range was corrupt; fetched again");
                }
                done = true;
                break;
            }
            if !done {
                return Err(WorkerError::Fetch(format!(
                    "range {}+{} of `{}` ({}) could not be fetched intact in {ATTEMPTS} attempts: {last}",
                    r.offset,
                    r.length,
                    r.file,
                    if r.tensor.is_empty() { "header" } else { &r.tensor }
                )));
            }
        }
        f.sync_all().map_err(|e| WorkerError::io(&p, e))?;
    }
    report.path =
        if m.files.len() == 1 && !m.files[0].path.ends_with(".json") && !m.files[0].path.ends_with(".safetensors") {
            dir.join(&m.files[0].path)
        } else {
            dir
        };
    Ok(report)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use brigade_proto::v1::ModelFile;

    fn manifest(data: &[u8]) -> SliceManifest {
        let range = |offset: u64, length: u64, tensor: &str| FileRange {
            file: "m.gguf".into(),
            offset,
            length,
            sha256: sha256_hex(&data[offset as usize..(offset + length) as usize]),
            tensor: tensor.into(),
        };
        SliceManifest {
            model_id: "abc".into(),
            model_name: "m".into(),
            files: vec![ModelFile { path: "m.gguf".into(), size: data.len() as u64 }],
            // a header and one "tensor"; the bytes between are another slice's
            ranges: vec![range(0, 100, ""), range(4000, 1000, "blk.3.x")],
            sources: vec!["coordinator".into()],
        }
    }

    #[test]
    fn fetches_only_the_slice_then_repairs_a_flipped_byte() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + 3) as u8).collect();
        let m = manifest(&data);
        let dir = tempfile::tempdir().unwrap();
        let mut calls = 0;
        let mut src = |r: &FileRange| {
            calls += 1;
            Ok(data[r.offset as usize..(r.offset + r.length) as usize].to_vec())
        };
        let rep = ensure_slice(dir.path(), &m, &mut src).unwrap();
        assert_eq!(rep.fetched_bytes, 1100, "only the slice's ranges move");
        assert_eq!((rep.fetched_ranges, rep.repaired_ranges), (2, 0));
        let path = dir.path().join("abc/m.gguf");
        assert_eq!(rep.path, path);
        let cached = std::fs::read(&path).unwrap();
        assert_eq!(cached.len(), data.len());
        assert_eq!(&cached[4000..5000], &data[4000..5000]);
        assert!(cached[200..3000].iter().all(|&b| b == 0), "other slices' bytes are never fetched");
        // second start: everything verified from the cache, nothing fetched
        let rep = ensure_slice(dir.path(), &m, &mut src).unwrap();
        assert_eq!(rep.fetched_bytes, 0);
        // a flipped byte in a cached tensor is detected and that range alone is fetched again
        let mut c = cached.clone();
        c[4500] ^= 0x40;
        std::fs::write(&path, &c).unwrap();
        let rep = ensure_slice(dir.path(), &m, &mut src).unwrap();
        assert_eq!((rep.fetched_bytes, rep.repaired_ranges), (1000, 1));
        assert_eq!(std::fs::read(&path).unwrap()[4500], data[4500]);
        assert_eq!(calls, 3);
    }

    #[test]
    fn corrupt_fetches_are_never_loaded() {
        let data: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let m = manifest(&data);
        let dir = tempfile::tempdir().unwrap();
        let mut n = 0;
        let e = ensure_slice(dir.path(), &m, |r| {
            n += 1;
            let mut b = data[r.offset as usize..(r.offset + r.length) as usize].to_vec();
            b[0] ^= 1;
            Ok(b)
        })
        .unwrap_err();
        assert_eq!(n, ATTEMPTS, "retried, then refused");
        assert!(e.to_string().contains("could not be fetched intact"), "{e}");
        // a truncated fetch, then a good one: loads
        let mut first = true;
        let rep = ensure_slice(dir.path(), &m, |r| {
            let mut b = data[r.offset as usize..(r.offset + r.length) as usize].to_vec();
            if std::mem::take(&mut first) {
                b.truncate(10);
            }
            Ok(b)
        })
        .unwrap();
        assert_eq!(rep.fetched_ranges, 2);
    }

    #[test]
    fn a_full_copy_is_used_in_place_and_hostile_manifests_are_refused() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let m = manifest(&data);
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("m.gguf"), &data).unwrap();
        let rep = ensure_slice(dir.path(), &m, |_| panic!("nothing to fetch")).unwrap();
        assert_eq!(rep.path, dir.path().join("m.gguf"));
        for bad in ["../etc", "a/b", ".hidden", ""] {
            let mut x = m.clone();
            x.files[0].path = bad.into();
            for r in &mut x.ranges {
                r.file = bad.into();
            }
            assert!(matches!(ensure_slice(dir.path(), &x, |_| Ok(vec![])), Err(WorkerError::Manifest(_))), "{bad}");
        }
        let mut x = m.clone();
        x.ranges[1].length = u64::MAX - 10;
        assert!(matches!(ensure_slice(dir.path(), &x, |_| Ok(vec![])), Err(WorkerError::Manifest(_))));
        let mut x = m;
        x.model_id = "../x".into();
        assert!(matches!(ensure_slice(dir.path(), &x, |_| Ok(vec![])), Err(WorkerError::Manifest(_))));
    }
}
