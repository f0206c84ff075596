//! Cluster chaos (issue 18): three nodes on a PostgreSQL server of the test's own, in front of
//! the mock provider, under the SQLite chaos test's workload (`crate::chaos`: duplicates sent to
//! different nodes, SDK-like retries to the next node, three log readers per stream, each
//! reconnecting to the next node with `Last-Event-ID`), while a driver, at seeded-random moments:
//! - SIGKILLs a node and restarts it on the same address;
//! - restarts PostgreSQL, with a fast shutdown (`SIGINT`) or an immediate one (`SIGQUIT`: a
//!   crash, recovery at the next start), starting it again 0–2 s later;
//! - pauses a node (SIGSTOP) for longer than the lease, then continues it (SIGCONT): its
//!   running attempts are recovered by the others while it sleeps, and what it writes when it
//!   wakes is fenced off (LC-3).
//!
//! A kill or a pause is aimed at a node that holds a running attempt: at its moment the driver
//! reads the running requests' lease owners (`<host>-<pid>/...`) from the database and takes
//! the scheduled node if it holds one, else the node holding the most, waiting (at most
//! [`HIT_WAIT`], polling the database) while none holds any. A node picked at random often
//! runs nothing at that moment (a request runs on the one node that recorded it), and a fault
//! that hits nothing tests nothing.
//!
//! After the faults stop, the shared checker (`crate::chaos::check`) asserts every request
//! terminal, one request per body, provider calls ≤ attempts, resets ≤ recoveries and every
//! reader's sequence consecutive and equal to the stored log; this test adds that no node died
//! of a fault it was not given, and that a request a killed or paused node was running was
//! recovered (LC-4): the faults hit running attempts. Counts are printed (`--no-capture`).
//!
//! The CI form (about 25 s) runs 2 kills, 2 database restarts (one of each mode) and 1 pause;
//! `CHAOS_LONG=1` runs the long form (12 kills, 8 restarts, 6 pauses over ~3 minutes of
//! traffic), reported in docs/reliability.md. `CHAOS_SEED=N` replays a run's fault schedule
//! (the seed is printed). In the `postgres` group of `scripts/test` (module `multinode::`).

use std::time::{Duration, Instant};

use holdfast::mock::MockConfig;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use sqlx::Connection;
use sqlx::postgres::PgConnection;

use super::pg_server::PrivatePostgres;
use crate::chaos::{Workload, chaos_http, check, run_reporting};
use crate::helpers::*;

const NODES: usize = 3;
const LEASE_SECS: u64 = 2;
/// A paused node sleeps this long: past its lease, so the others recover its attempts.
const PAUSE: Duration = Duration::from_millis(LEASE_SECS * 1000 + 1500);
/// How long a kill or a pause waits for a node to hold a running attempt before it goes ahead
/// on the scheduled node anyway (the workload may be over; the final check then fails).
const HIT_WAIT: Duration = Duration::from_secs(10);

/// The size of a run.
struct Plan {
    kills: usize,
    pg_fast: usize,
    pg_immediate: usize,
    pauses: usize,
    /// Distinct bodies (each sent 3 times, to three different nodes).
    logical: usize,
    /// Bodies start spread over this long; the faults fall inside it.
    spread: Duration,
    /// Milliseconds between faults (uniform).
    gap_ms: std::ops::Range<u64>,
}

impl Plan {
    fn from_env() -> Plan {
        if std::env::var("CHAOS_LONG").is_ok_and(|v| v == "1") {
            Plan {
                kills: 12,
                pg_fast: 4,
                pg_immediate: 4,
                pauses: 6,
                logical: 1800,
                spread: Duration::from_secs(180),
                gap_ms: 2500..6500,
            }
        } else {
            Plan {
                kills: 2,
                pg_fast: 1,
                pg_immediate: 1,
                pauses: 1,
                logical: 200,
                spread: Duration::from_secs(20),
                gap_ms: 500..2000,
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    Kill(usize),
    /// Stopped, then started again after `down_ms`.
    RestartPostgres {
        immediate: bool,
        down_ms: u64,
    },
    Pause(usize),
}

/// What the driver did, for the report.
#[derive(Debug, Default)]
struct Driven {
    kills: usize,
    pg_fast: usize,
    pg_immediate: usize,
    pauses: usize,
    /// Longest time from a stop of PostgreSQL to its accepting connections again.
    pg_down_max: Duration,
    /// Longest time from a SIGKILL to the restarted node answering `/healthz`.
    node_down_max: Duration,
    /// The requests the killed or paused nodes were running when their fault hit.
    hit: Vec<String>,
    log: Vec<String>,
}

/// The requests each node's process (`pids`, by node) runs now: `running`, with a lease that
/// has not expired, whose owner (`<host>-<pid>/<uuid>`, `WorkerPool::lease_owner`) is that
/// process. `None` when the database cannot be read.
async fn running_by_node(conn: &mut PgConnection, pids: &[u32]) -> Option<Vec<Vec<String>>> {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT id::text, lease_owner FROM requests
         WHERE status = 'running' AND lease_expires_at > $1",
    )
    .bind(now_ms)
    .fetch_all(conn)
    .await
    .ok()?;
    let mut held = vec![Vec::new(); pids.len()];
    for (id, owner) in rows {
        let pid = owner
            .split_once('/')
            .and_then(|(node, _)| node.rsplit_once('-'))
            .and_then(|(_, pid)| pid.parse::<u32>().ok());
        if let Some(n) = pids.iter().position(|p| Some(*p) == pid) {
            held[n].push(id);
        }
    }
    Some(held)
}

/// The node a kill or a pause scheduled for `scheduled` is aimed at, and the requests it runs:
/// `scheduled` if it runs one, else the node running the most. While no node runs anything it
/// polls the database every 20 ms, for at most [`HIT_WAIT`]; then it is `scheduled`, running
/// nothing.
async fn aim(db_url: &str, nodes: &[Process], scheduled: usize) -> (usize, Vec<String>) {
    let pids: Vec<u32> = nodes.iter().map(|n| n.child.id()).collect();
    let deadline = Instant::now() + HIT_WAIT;
    let mut conn = None;
    while Instant::now() < deadline {
        if conn.is_none() {
            conn = tokio::time::timeout(Duration::from_secs(2), PgConnection::connect(db_url))
                .await
                .ok()
                .and_then(Result::ok);
        }
        let read = match conn.as_mut() {
            Some(c) => running_by_node(c, &pids).await,
            None => None,
        };
        if read.is_none() {
            // Connect again at the next try.
            conn = None;
        }
        if let Some(mut held) = read {
            if !held[scheduled].is_empty() {
                return (scheduled, std::mem::take(&mut held[scheduled]));
            }
            if let Some(n) = (0..held.len()).max_by_key(|n| held[*n].len())
                && !held[n].is_empty()
            {
                return (n, std::mem::take(&mut held[n]));
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (scheduled, Vec::new())
}

/// Sends `signal` to `node`'s process.
fn signal(node: &Process, signal: i32) {
    let pid = node.child.id();
    // SAFETY: kill(2) on the pid of our own child, which is not reaped while `node` lives.
    let sent = unsafe { libc::kill(pid as i32, signal) };
    assert_eq!(sent, 0, "kill({pid}, {signal})");
}

#[tokio::test]
async fn cluster_chaos_node_kills_pauses_and_postgres_restarts_keep_every_invariant_du3_lc3_rd4() {
    let plan = Plan::from_env();
    let seed: u64 = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    println!("cluster_chaos: seed={seed} (CHAOS_SEED={seed} replays the fault schedule)");
    let mut rng = StdRng::seed_from_u64(seed);

    let mut pg = PrivatePostgres::create().await;
    let db_url = pg.url();
    let mock = start_mock(MockConfig {
        chunks: 10,
        chunk_delay_ms: 60,
        header_delay_ms: 300,
        ..MockConfig::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let toml = fault_test_toml(
        &pg.url(),
        &format!(
            "database_pool_size = 6\n{}",
            crate::callbacks::chaos_callbacks_toml()
        ),
        LEASE_SECS,
        &mock.base_url(),
    );
    let receiver = crate::callbacks::chaos_receiver().await;
    let addrs: Vec<_> = (0..NODES).map(|_| free_addr()).collect();
    let mut starts = [0usize; NODES];
    let node_dir = |n: usize, start: usize| {
        let d = dir.path().join(format!("node{n}-{start}"));
        std::fs::create_dir_all(&d).unwrap();
        d
    };
    let mut nodes = Vec::new();
    for (n, addr) in addrs.iter().enumerate() {
        nodes.push(Process::serve_logged(&node_dir(n, 0), &toml, *addr, &[]).await);
    }

    // The schedule: every fault of the plan, in a seeded order, each node chosen at random.
    let mut faults = Vec::new();
    for _ in 0..plan.kills {
        faults.push(Fault::Kill(rng.random_range(0..NODES)));
    }
    for _ in 0..plan.pg_fast {
        faults.push(Fault::RestartPostgres {
            immediate: false,
            down_ms: rng.random_range(0..2000),
        });
    }
    for _ in 0..plan.pg_immediate {
        faults.push(Fault::RestartPostgres {
            immediate: true,
            down_ms: rng.random_range(0..2000),
        });
    }
    for _ in 0..plan.pauses {
        faults.push(Fault::Pause(rng.random_range(0..NODES)));
    }
    faults.shuffle(&mut rng);
    let gaps: Vec<u64> = faults
        .iter()
        .map(|_| rng.random_range(plan.gap_ms.clone()))
        .collect();

    let workload = Workload {
        prefix: "cluster chaos",
        logical: plan.logical,
        copies: NODES,
        spread: plan.spread,
        bases: addrs.iter().map(|a| format!("http://{a}")).collect(),
        stream_errors: &["attempt_abandoned", "store_unavailable"],
        readers_per_stream: NODES,
        callback_url: Some(receiver.url.clone()),
        early_start: false,
    };
    let began = Instant::now();
    let driver = async {
        let mut driven = Driven::default();
        for (fault, gap) in faults.iter().zip(&gaps) {
            // A fault is a moment: the gap before it is the schedule, not a wait for state.
            // A kill or a pause then waits (bounded) for a node running an attempt, and hits it.
            tokio::time::sleep(Duration::from_millis(*gap)).await;
            let at = began.elapsed().as_secs_f64();
            match *fault {
                Fault::Kill(scheduled) => {
                    let (n, held) = aim(&db_url, &nodes, scheduled).await;
                    let at = began.elapsed().as_secs_f64();
                    let down = Instant::now();
                    nodes[n].kill9();
                    starts[n] += 1;
                    nodes[n] =
                        Process::serve_logged(&node_dir(n, starts[n]), &toml, addrs[n], &[]).await;
                    driven.kills += 1;
                    driven.node_down_max = driven.node_down_max.max(down.elapsed());
                    driven.log.push(format!(
                        "{at:.1}s kill node {n} running {} attempts (back in {:.2}s)",
                        held.len(),
                        down.elapsed().as_secs_f64()
                    ));
                    driven.hit.extend(held);
                }
                Fault::RestartPostgres { immediate, down_ms } => {
                    let down = Instant::now();
                    pg.stop(if immediate {
                        libc::SIGQUIT
                    } else {
                        libc::SIGINT
                    })
                    .await;
                    // Down for a while by design, as a restart that takes time.
                    tokio::time::sleep(Duration::from_millis(down_ms)).await;
                    pg.start().await;
                    if immediate {
                        driven.pg_immediate += 1;
                    } else {
                        driven.pg_fast += 1;
                    }
                    driven.pg_down_max = driven.pg_down_max.max(down.elapsed());
                    driven.log.push(format!(
                        "{at:.1}s restart postgres ({}, down {:.2}s)",
                        if immediate { "immediate" } else { "fast" },
                        down.elapsed().as_secs_f64()
                    ));
                }
                Fault::Pause(scheduled) => {
                    let (n, held) = aim(&db_url, &nodes, scheduled).await;
                    let at = began.elapsed().as_secs_f64();
                    signal(&nodes[n], libc::SIGSTOP);
                    // The pause is a duration by design: longer than the lease.
                    tokio::time::sleep(PAUSE).await;
                    signal(&nodes[n], libc::SIGCONT);
                    driven.pauses += 1;
                    driven.log.push(format!(
                        "{at:.1}s pause node {n} running {} attempts for {:.1}s",
                        held.len(),
                        PAUSE.as_secs_f64()
                    ));
                    driven.hit.extend(held);
                }
            }
        }
        driven
    };
    let (outcome, driven) = tokio::join!(run_reporting(&workload, &mock, dir.path()), driver);
    let faults_over = began.elapsed();
    for line in &driven.log {
        println!("cluster_chaos: {line}");
    }
    assert_eq!(
        (
            driven.kills,
            driven.pg_fast,
            driven.pg_immediate,
            driven.pauses
        ),
        (plan.kills, plan.pg_fast, plan.pg_immediate, plan.pauses),
        "every planned fault ran"
    );
    for (n, node) in nodes.iter_mut().enumerate() {
        assert!(
            node.child.try_wait().unwrap().is_none(),
            "node {n} is still up: no fault but a SIGKILL ends a node"
        );
    }
    let (retries, reconnects) = (outcome.retries, outcome.reconnects);
    let counts = check(&workload, outcome, &mock).await;
    let told = crate::callbacks::check_deliveries(&chaos_http(), workload.base(0), &receiver).await;
    println!(
        "cluster_chaos: callbacks={} webhooks_received={} webhook_ids_repeated={} (every one \
         delivered, signed)",
        told.requests, told.received, told.repeated
    );
    println!(
        "cluster_chaos: nodes={NODES} requests={} (logical {} x {NODES}) kills={} \
         pg_restarts_fast={} pg_restarts_immediate={} pauses={} (each {:.1}s, lease {LEASE_SECS}s) \
         pg_down_max={:.2}s node_down_max={:.2}s | logged={} unknown_to_clients={} attempts={} \
         recoveries={} resets={} provider_calls={} client_retries={retries} readers={} \
         reader_events={} reader_reconnects={reconnects} | workload and faults over at {:.1}s, all terminal \
         {:.1}s later, violations=0",
        counts.sent,
        plan.logical,
        driven.kills,
        driven.pg_fast,
        driven.pg_immediate,
        driven.pauses,
        PAUSE.as_secs_f64(),
        driven.pg_down_max.as_secs_f64(),
        driven.node_down_max.as_secs_f64(),
        counts.logged,
        counts.unknown_to_clients,
        counts.attempts,
        counts.recoveries,
        counts.resets,
        counts.provider_calls,
        counts.readers,
        counts.reader_events,
        faults_over.as_secs_f64(),
        counts.settled.as_secs_f64(),
    );
    // The faults hit running attempts (else the run tested nothing): a request that a killed or
    // paused node was running when its fault struck was recovered by a sweep (LC-4). One of
    // them may have finished between the driver's read and the signal, not all of them.
    let mut conn = PgConnection::connect(&db_url)
        .await
        .expect("connect to the test's database");
    let recovered: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM requests WHERE id::text = ANY($1) AND recoveries >= 1",
    )
    .bind(&driven.hit)
    .fetch_one(&mut conn)
    .await
    .expect("count the hit requests recovered");
    assert!(
        recovered >= 1,
        "the faults hit running attempts: {recovered} of the {} requests the killed or paused \
         nodes were running were recovered, {} recoveries in all (else the workload is too \
         thin to test anything)",
        driven.hit.len(),
        counts.recoveries
    );
    drop(nodes);
    drop(pg);
    mock.shutdown().await;
}
