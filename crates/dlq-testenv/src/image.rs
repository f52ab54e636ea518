//! Container images without a Docker daemon: an OCI image archive written here and imported
//! into the test node's containerd (`ctr images import`).
//!
//! The operator image follows the Dockerfile's final stage, read from the Dockerfile itself
//! ([`FinalStage`]): its user, entrypoint, command, exposed port, labels and the directory the
//! binaries are copied to. Its base, `gcr.io/distroless/cc-debian12:nonroot`, is rebuilt from this
//! Debian 12 machine's own files: the shared libraries the binaries need (as `ldd` names them),
//! CA certificates, `/etc/passwd` with `nonroot` (65532), `/home/nonroot` and `/tmp`. No shell,
//! no package manager, as in distroless.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::plane::{TestenvError, io};

type Result<T, E = TestenvError> = std::result::Result<T, E>;

/// The repository of the image `make image-local` builds; the tag is the manifest's digest.
pub const OPERATOR_REPOSITORY: &str = "dlq.local/deadletter-operator";

/// The instructions of a Dockerfile's final stage that shape the runtime image.
#[derive(Debug, Default, PartialEq)]
pub struct FinalStage {
    /// USER, ENTRYPOINT, CMD, EXPOSE, LABEL.
    pub runtime: Runtime,
    /// Where `COPY --from=…` puts the binaries, and their names.
    pub copy_dest: String,
    pub copied: Vec<String>,
    /// Files `COPY`d from the build context (the LICENSE): (path in the context, path in the
    /// image).
    pub context_files: Vec<(String, String)>,
}

/// The instructions of `dockerfile`, continuation lines joined, comments dropped.
fn instructions(dockerfile: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in dockerfile.lines().map(str::trim) {
        if line.starts_with('#') || (line.is_empty() && current.is_empty()) {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(part) => current.push_str(part),
            None => {
                current.push_str(line);
                out.push(std::mem::take(&mut current));
            }
        }
    }
    out
}

/// `key="value" key2="value 2"` pairs of a LABEL instruction.
fn label_pairs(rest: &str) -> Vec<(String, String)> {
    let mut pairs = Vec::new();
    let mut s = rest.trim();
    while let Some((key, after)) = s.split_once("=\"") {
        let Some((value, tail)) = after.split_once('"') else {
            break;
        };
        pairs.push((key.trim().to_string(), value.to_string()));
        s = tail.trim();
    }
    pairs
}

fn exec_form(rest: &str) -> Result<Vec<String>> {
    serde_json::from_str(rest).map_err(|e| {
        TestenvError::Setup(format!(
            "Dockerfile: `{rest}` is not an exec-form list: {e}"
        ))
    })
}

/// An EXPOSE port as an OCI `ExposedPorts` key (`8080` is `8080/tcp`).
fn port(p: &str) -> String {
    match p.contains('/') {
        true => p.to_string(),
        false => format!("{p}/tcp"),
    }
}

impl FinalStage {
    /// Reads the final stage (after the last `FROM`) of a Dockerfile's text.
    pub fn parse(dockerfile: &str) -> Result<FinalStage> {
        let all = instructions(dockerfile);
        let start = all
            .iter()
            .rposition(|i| i.to_ascii_uppercase().starts_with("FROM "))
            .ok_or_else(|| TestenvError::Setup("Dockerfile has no FROM".into()))?;
        let mut stage = FinalStage::default();
        for inst in &all[start + 1..] {
            let (op, rest) = inst.split_once(' ').unwrap_or((inst, ""));
            let rest = rest.trim();
            match op.to_ascii_uppercase().as_str() {
                "USER" => stage.runtime.user = rest.to_string(),
                "ENTRYPOINT" => stage.runtime.entrypoint = exec_form(rest)?,
                "CMD" => stage.runtime.cmd = exec_form(rest)?,
                "EXPOSE" => stage
                    .runtime
                    .exposed
                    .extend(rest.split_whitespace().map(port)),
                "LABEL" => stage.runtime.labels.extend(label_pairs(rest)),
                "COPY" => stage.read_copy(rest),
                _ => {}
            }
        }
        Ok(stage)
    }

    fn read_copy(&mut self, rest: &str) {
        let from_stage = rest.split_whitespace().any(|w| w.starts_with("--from="));
        let words: Vec<&str> = rest
            .split_whitespace()
            .filter(|w| !w.starts_with("--"))
            .collect();
        let Some((dest, sources)) = words.split_last() else {
            return;
        };
        if !from_stage {
            for source in sources {
                let name = Path::new(source).file_name().and_then(|n| n.to_str());
                let target = match (dest.ends_with('/'), name) {
                    (true, Some(name)) => format!("{dest}{name}"),
                    _ => dest.to_string(),
                };
                self.context_files.push((source.to_string(), target));
            }
            return;
        }
        self.copy_dest = dest.to_string();
        self.copied.extend(
            sources
                .iter()
                .filter_map(|s| Path::new(s).file_name()?.to_str().map(String::from)),
        );
    }

    /// The repository's Dockerfile.
    pub fn of_checkout() -> Result<FinalStage> {
        let path = crate::paths::workspace_root().join("Dockerfile");
        FinalStage::parse(&io(
            format!("reading {}", path.display()),
            fs::read_to_string(&path),
        )?)
    }
}

/// One layer's files: (path in the image, contents from the host, mode).
#[derive(Default)]
pub struct Layer {
    files: Vec<(String, PathBuf, u32)>,
    texts: Vec<(String, String)>,
    /// Directories with (mode, uid).
    dirs: Vec<(String, u32, u32)>,
}

impl Layer {
    pub fn file(mut self, image_path: &str, host: &Path, mode: u32) -> Self {
        self.files
            .push((image_path.to_string(), host.to_path_buf(), mode));
        self
    }

    pub fn text(mut self, image_path: &str, contents: &str) -> Self {
        self.texts
            .push((image_path.to_string(), contents.to_string()));
        self
    }

    pub fn dir(mut self, image_path: &str, mode: u32, uid: u32) -> Self {
        self.dirs.push((image_path.to_string(), mode, uid));
        self
    }

    /// Lays the files out under `root` and tars them (sorted, mtime 0, numeric owners: the
    /// same inputs give the same digest).
    fn tar(&self, root: &Path, out: &Path) -> Result<()> {
        use std::os::unix::fs::{PermissionsExt, chown};
        let inside = |p: &str| root.join(p.trim_start_matches('/'));
        let mkparent = |p: &Path| match p.parent() {
            Some(d) => io(format!("creating {}", d.display()), fs::create_dir_all(d)),
            None => Ok(()),
        };
        for (path, host, mode) in &self.files {
            let dest = inside(path);
            mkparent(&dest)?;
            io(
                format!("copying {} into the image", host.display()),
                fs::copy(host, &dest),
            )?;
            io(
                "chmod",
                fs::set_permissions(&dest, fs::Permissions::from_mode(*mode)),
            )?;
        }
        for (path, text) in &self.texts {
            let dest = inside(path);
            mkparent(&dest)?;
            io(format!("writing {path}"), fs::write(&dest, text))?;
            io(
                "chmod",
                fs::set_permissions(&dest, fs::Permissions::from_mode(0o644)),
            )?;
        }
        for (path, mode, uid) in &self.dirs {
            let dest = inside(path);
            io(format!("creating {path}"), fs::create_dir_all(&dest))?;
            io(
                "chmod",
                fs::set_permissions(&dest, fs::Permissions::from_mode(*mode)),
            )?;
            io("chown", chown(&dest, Some(*uid), Some(*uid)))?;
        }
        run(Command::new("tar")
            .args([
                "--sort=name",
                "--mtime=@0",
                "--numeric-owner",
                "--format=gnu",
                "-C",
            ])
            .arg(root)
            .arg("-cf")
            .arg(out)
            .arg("."))
    }
}

fn run(cmd: &mut Command) -> Result<()> {
    let out = io(format!("running {:?}", cmd.get_program()), cmd.output())?;
    if out.status.success() {
        return Ok(());
    }
    Err(TestenvError::Setup(format!(
        "{cmd:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    )))
}

/// What an image runs, as in an OCI image config's `config` object.
#[derive(Debug, Default, PartialEq)]
pub struct Runtime {
    pub user: String,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub exposed: Vec<String>,
    pub labels: BTreeMap<String, String>,
}

/// An OCI image archive on disk and the reference it is imported under.
pub struct Archive {
    pub path: PathBuf,
    pub reference: String,
}

/// A blob in `blobs/sha256/`: its digest and size.
fn put_blob(layout: &Path, bytes: &[u8]) -> Result<(String, usize)> {
    let hex = hex::encode(Sha256::digest(bytes));
    let dir = layout.join("blobs/sha256");
    io("creating blobs/", fs::create_dir_all(&dir))?;
    io("writing a blob", fs::write(dir.join(&hex), bytes))?;
    Ok((format!("sha256:{hex}"), bytes.len()))
}

fn config_json(runtime: &Runtime, diff_ids: &[String]) -> Value {
    let exposed: serde_json::Map<String, Value> = runtime
        .exposed
        .iter()
        .map(|p| (p.clone(), json!({})))
        .collect();
    json!({
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {
            "User": runtime.user,
            "Entrypoint": runtime.entrypoint,
            "Cmd": runtime.cmd,
            "ExposedPorts": exposed,
            "Env": [
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"
            ],
            "WorkingDir": "/",
            "Labels": runtime.labels,
        },
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    })
}

/// Writes an OCI image archive of `layers` to `out` (`<repository>:<12 hex of the manifest
/// digest>`), built in `work` (emptied first).
pub fn build(
    repository: &str,
    layers: &[Layer],
    runtime: &Runtime,
    work: &Path,
    out: &Path,
) -> Result<Archive> {
    let _ = fs::remove_dir_all(work);
    let layout = work.join("layout");
    io("creating the layout dir", fs::create_dir_all(&layout))?;
    let (mut descriptors, mut diff_ids) = (Vec::new(), Vec::new());
    for (i, layer) in layers.iter().enumerate() {
        let tar = work.join(format!("layer{i}.tar"));
        layer.tar(&work.join(format!("root{i}")), &tar)?;
        let bytes = io("reading a layer", fs::read(&tar))?;
        let (digest, size) = put_blob(&layout, &bytes)?;
        diff_ids.push(digest.clone());
        descriptors.push(json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": digest, "size": size
        }));
    }
    let config = serde_json::to_vec(&config_json(runtime, &diff_ids)).unwrap_or_default();
    let (config_digest, config_size) = put_blob(&layout, &config)?;
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": config_size},
        "layers": descriptors,
    }))
    .unwrap_or_default();
    let (manifest_digest, manifest_size) = put_blob(&layout, &manifest)?;
    let tag = manifest_digest
        .strip_prefix("sha256:")
        .and_then(|hex| hex.get(..12))
        .unwrap_or("latest");
    let reference = format!("{repository}:{tag}");
    write_index(&layout, &reference, tag, (&manifest_digest, manifest_size))?;
    if let Some(parent) = out.parent() {
        io("creating the image dir", fs::create_dir_all(parent))?;
    }
    run(Command::new("tar")
        .args(["--sort=name", "--mtime=@0", "--numeric-owner", "-C"])
        .arg(&layout)
        .arg("-cf")
        .arg(out)
        .arg("."))?;
    Ok(Archive {
        path: out.to_path_buf(),
        reference,
    })
}

/// `index.json` naming the manifest: containerd's `ctr images import` takes the full reference
/// from `io.containerd.image.name`.
fn write_index(layout: &Path, reference: &str, tag: &str, manifest: (&str, usize)) -> Result<()> {
    let index = json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest.0, "size": manifest.1,
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {
                "io.containerd.image.name": reference,
                "org.opencontainers.image.ref.name": tag,
            },
        }],
    });
    io(
        "writing oci-layout",
        fs::write(
            layout.join("oci-layout"),
            r#"{"imageLayoutVersion":"1.0.0"}"#,
        ),
    )?;
    io(
        "writing index.json",
        fs::write(layout.join("index.json"), index.to_string()),
    )
}

/// `ctr` against the containerd at `socket`, in the namespace kubelet's CRI uses (`k8s.io`).
pub fn ctr(ctr: &Path, socket: &Path) -> Command {
    let mut cmd = Command::new(ctr);
    cmd.arg("--address")
        .arg(socket)
        .args(["--namespace", "k8s.io"]);
    cmd
}

/// Imports an image archive into the containerd at `socket` (unpacked for its default
/// snapshotter): pods use it with `imagePullPolicy: Never` or `IfNotPresent`.
pub fn import(ctr_bin: &Path, socket: &Path, archive: &Archive) -> Result<()> {
    run(ctr(ctr_bin, socket)
        .args(["images", "import"])
        .arg(&archive.path))
}

/// The shared libraries `binary` loads, as `ldd` resolves them on this machine (the loader
/// included), each with the path the binary looks for.
pub fn shared_libraries(binary: &Path) -> Result<Vec<(String, PathBuf)>> {
    let out = io("running ldd", Command::new("ldd").arg(binary).output())?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut libs = Vec::new();
    for line in text.lines().map(str::trim) {
        let path = match line.split_once(" => ") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line
                .split_whitespace()
                .next()
                .filter(|p| p.starts_with('/')),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            libs.push((p.to_string(), PathBuf::from(p)));
        }
    }
    if libs.is_empty() && !text.contains("statically linked") {
        return Err(TestenvError::Setup(format!(
            "ldd {} named no libraries: {}",
            binary.display(),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(libs)
}

const PASSWD: &str = "root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n";
const GROUP: &str = "root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n";

/// distroless `cc-debian12:nonroot` from this machine's files, for `binaries`.
pub fn distroless_cc(binaries: &[&Path]) -> Result<Layer> {
    let mut layer = Layer::default()
        .text("/etc/passwd", PASSWD)
        .text("/etc/group", GROUP)
        .text("/etc/nsswitch.conf", "hosts: files dns\n")
        .file(
            "/etc/ssl/certs/ca-certificates.crt",
            Path::new("/etc/ssl/certs/ca-certificates.crt"),
            0o644,
        )
        .dir("/tmp", 0o1777, 0)
        .dir("/home/nonroot", 0o700, 65532);
    let mut seen = std::collections::BTreeSet::new();
    for binary in binaries {
        for (path, host) in shared_libraries(binary)? {
            if seen.insert(path.clone()) {
                layer = layer.file(&path, &host, 0o755);
            }
        }
    }
    Ok(layer)
}

/// The operator image: the Dockerfile's final stage over [`distroless_cc`], with `binaries`
/// (the operator and kubectl-dlq, by file name as the Dockerfile copies them).
pub fn operator_image(binaries: &[&Path], work: &Path, out: &Path) -> Result<Archive> {
    let stage = FinalStage::of_checkout()?;
    let mut app = Layer::default();
    for name in &stage.copied {
        let host = binaries
            .iter()
            .find(|b| b.file_name().and_then(|n| n.to_str()) == Some(name))
            .ok_or_else(|| {
                TestenvError::Setup(format!("the Dockerfile copies {name}: pass its binary"))
            })?;
        let dest = format!("{}/{name}", stage.copy_dest.trim_end_matches('/'));
        app = app.file(&dest, host, 0o755);
    }
    let root = crate::paths::workspace_root();
    for (source, dest) in &stage.context_files {
        app = app.file(dest, &root.join(source), 0o644);
    }
    build(
        OPERATOR_REPOSITORY,
        &[distroless_cc(binaries)?, app],
        &stage.runtime,
        work,
        out,
    )
}

/// The node's sandbox image: Kubernetes' `pause`, static, as user 65535.
pub fn pause_image(pause: &Path, repository: &str, work: &Path, out: &Path) -> Result<Archive> {
    let runtime = Runtime {
        user: "65535:65535".into(),
        entrypoint: vec!["/pause".into()],
        cmd: vec![],
        exposed: vec![],
        labels: BTreeMap::new(),
    };
    let layer = Layer::default().file("/pause", pause, 0o755);
    build(repository, &[layer], &runtime, work, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_final_stage_of_the_checkouts_dockerfile() {
        let stage = FinalStage::of_checkout().expect("Dockerfile parses");
        assert_eq!(stage.runtime.user, "65532:65532");
        assert_eq!(
            stage.runtime.entrypoint,
            ["/usr/local/bin/deadletter-operator"]
        );
        assert_eq!(stage.runtime.cmd, ["run"]);
        assert_eq!(stage.runtime.exposed, ["8080/tcp"]);
        assert_eq!(stage.copy_dest, "/usr/local/bin/");
        assert_eq!(stage.copied, ["deadletter-operator", "kubectl-dlq"]);
        assert_eq!(
            stage.context_files,
            [(
                "LICENSE".to_string(),
                "/usr/share/doc/deadletter-operator/LICENSE".to_string()
            )]
        );
        assert_eq!(
            stage
                .runtime
                .labels
                .get("org.opencontainers.image.title")
                .map(String::as_str),
            Some("deadletter-operator")
        );
    }

    #[test]
    fn only_the_last_stage_counts() {
        let stage = FinalStage::parse(
            "FROM a AS build\nUSER 1\nENTRYPOINT [\"/x\"]\n# c\nFROM b\nLABEL k=\"v w\" \\\n  j=\"u\"\n",
        )
        .expect("parses");
        assert_eq!(stage.runtime.user, "");
        assert!(stage.runtime.entrypoint.is_empty());
        assert_eq!(stage.runtime.labels.len(), 2);
        assert_eq!(stage.runtime.labels["k"], "v w");
    }
}
