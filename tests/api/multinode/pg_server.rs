//! A PostgreSQL server of a test's own (`initdb` into a temporary directory, `postgres` on a free
//! loopback port, as the `postgres` user when the test runs as root), stopped and started at will
//! without touching the shared server other tests use. Needs PostgreSQL's server binaries
//! (Debian: `apt-get install postgresql`).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use sqlx::Connection;
use sqlx::postgres::PgConnection;
use tempfile::TempDir;

use crate::helpers::*;

/// PostgreSQL's server binaries: the newest `/usr/lib/postgresql/<version>/bin` (Debian), else
/// `initdb` on PATH.
fn postgres_bin_dir() -> PathBuf {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            (bin.join("initdb").exists() && bin.join("postgres").exists()).then_some((version, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return bin;
    }
    if let Ok(out) = std::process::Command::new("sh")
        .args(["-c", "command -v initdb"])
        .output()
        && out.status.success()
    {
        let initdb = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if let Some(bin) = initdb.parent() {
            return bin.to_path_buf();
        }
    }
    missing_dependency(
        "postgres",
        "PostgreSQL's server binaries (initdb, postgres) are not installed",
        "apt-get install postgresql (the test runs a private server of its own)",
    )
}

/// The uid and gid to run PostgreSQL as: the `postgres` user when this process is root (the
/// server refuses to run as root), else this process's own.
fn server_user() -> Option<(u32, u32)> {
    // SAFETY: geteuid has no preconditions; getpwnam gets a NUL-terminated name and its result
    // is read before any other call that could reuse its static buffer.
    unsafe {
        if libc::geteuid() != 0 {
            return None;
        }
        let pw = libc::getpwnam(c"postgres".as_ptr());
        if pw.is_null() {
            missing_dependency(
                "postgres",
                "running as root, and there is no `postgres` user to run a private PostgreSQL as",
                "install PostgreSQL from the distribution (it creates the user), or run the \
                 tests as an ordinary user",
            );
        }
        Some(((*pw).pw_uid, (*pw).pw_gid))
    }
}

/// A PostgreSQL server of this test's own, stopped and started at will. Dropped: shut down
/// (immediate mode) and its directory removed.
pub struct PrivatePostgres {
    bin: PathBuf,
    user: Option<(u32, u32)>,
    dir: TempDir,
    port: u16,
    server: Option<tokio::process::Child>,
    pub starts: u32,
}

impl PrivatePostgres {
    /// `initdb` into a temporary directory, then start the server on a free loopback port.
    pub async fn create() -> PrivatePostgres {
        let bin = postgres_bin_dir();
        let user = server_user();
        let dir = tempfile::tempdir().expect("tempdir");
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).expect("chown");
        }
        let mut initdb = std::process::Command::new(bin.join("initdb"));
        initdb
            .arg("-D")
            .arg(dir.path().join("data"))
            .args([
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--locale=C",
                "-N",
            ])
            .stdout(Stdio::null());
        if let Some((uid, gid)) = user {
            std::os::unix::process::CommandExt::uid(&mut initdb, uid);
            std::os::unix::process::CommandExt::gid(&mut initdb, gid);
        }
        let out = initdb.output().expect("run initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut pg = PrivatePostgres {
            bin,
            user,
            port: free_addr().port(),
            dir,
            server: None,
            starts: 0,
        };
        pg.start().await;
        pg
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("postgres.log")
    }

    /// Starts the server and waits until it accepts connections (at most 30 s).
    pub async fn start(&mut self) {
        assert!(self.server.is_none(), "already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())
            .expect("postgres log");
        let mut command = tokio::process::Command::new(self.bin.join("postgres"));
        command
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-k")
            .arg(self.dir.path())
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        if let Some((uid, gid)) = self.user {
            command.uid(uid).gid(gid);
        }
        self.server = Some(command.spawn().expect("spawn postgres"));
        self.starts += 1;
        let start = Instant::now();
        loop {
            let attempt =
                tokio::time::timeout(Duration::from_secs(2), PgConnection::connect(&self.url()))
                    .await;
            if let Ok(Ok(conn)) = attempt {
                let _ = conn.close().await;
                return;
            }
            if let Some(server) = &mut self.server
                && let Ok(Some(status)) = server.try_wait()
            {
                panic!("postgres exited ({status}):\n{}", self.log_text());
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "postgres did not accept connections within 30 s:\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops the server: `signal` SIGINT is PostgreSQL's fast shutdown (sessions terminated,
    /// a clean checkpoint), SIGQUIT its immediate one (everything killed, crash recovery at
    /// the next start). Waits for it to exit (at most 30 s).
    pub async fn stop(&mut self, signal: i32) {
        let mut server = self.server.take().expect("running");
        let pid = server.id().expect("pid");
        // SAFETY: kill(2) on the pid of our own child, which we have not reaped yet.
        let sent = unsafe { libc::kill(pid as i32, signal) };
        assert_eq!(sent, 0, "kill postgres");
        tokio::time::timeout(Duration::from_secs(30), server.wait())
            .await
            .expect("postgres stops within 30 s")
            .expect("wait for postgres");
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(self.log()).unwrap_or_default()
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        if let Some(mut server) = self.server.take()
            && let Some(pid) = server.id()
        {
            // SAFETY: as in `stop`.
            unsafe { libc::kill(pid as i32, libc::SIGQUIT) };
            let start = Instant::now();
            while !matches!(server.try_wait(), Ok(Some(_)))
                && start.elapsed() < Duration::from_secs(10)
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = server.start_kill();
        }
    }
}
