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
//! After the faults stop, the shared checker (`crate::chaos::check`) asserts every request
//! terminal, one request per body, provider calls ≤ attempts, resets ≤ recoveries and every
//! reader's sequence consecutive and equal to the stored log; this test adds that no node died
//! of a fault it was not given. Counts are printed (`--no-capture`).
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

use super::pg_server::PrivatePostgres;
use crate::chaos::{Workload, chaos_http, check, run_reporting};
use crate::helpers::*;

const NODES: usize = 3;
const LEASE_SECS: u64 = 2;
/// A paused node sleeps this long: past its lease, so the others recover its attempts.
const PAUSE: Duration = Duration::from_millis(LEASE_SECS * 1000 + 1500);

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
    log: Vec<String>,
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
            tokio::time::sleep(Duration::from_millis(*gap)).await;
            let at = began.elapsed().as_secs_f64();
            match *fault {
                Fault::Kill(n) => {
                    let down = Instant::now();
                    nodes[n].kill9();
                    starts[n] += 1;
                    nodes[n] =
                        Process::serve_logged(&node_dir(n, starts[n]), &toml, addrs[n], &[]).await;
                    driven.kills += 1;
                    driven.node_down_max = driven.node_down_max.max(down.elapsed());
                    driven.log.push(format!(
                        "{at:.1}s kill node {n} (back in {:.2}s)",
                        down.elapsed().as_secs_f64()
                    ));
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
                Fault::Pause(n) => {
                    signal(&nodes[n], libc::SIGSTOP);
                    // The pause is a duration by design: longer than the lease.
                    tokio::time::sleep(PAUSE).await;
                    signal(&nodes[n], libc::SIGCONT);
                    driven.pauses += 1;
                    driven.log.push(format!(
                        "{at:.1}s pause node {n} for {:.1}s",
                        PAUSE.as_secs_f64()
                    ));
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
    assert!(
        counts.recoveries >= 1,
        "the faults hit running attempts (else the workload is too thin to test anything)"
    );
    drop(nodes);
    drop(pg);
    mock.shutdown().await;
}
