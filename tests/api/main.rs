//! Black-box tests over real sockets: holdfast in front of the mock provider (one test binary,
//! shared helpers; see `helpers.rs`). Test names say the behaviour; comments cite SPEC ids.

// Tests unwrap freely: a panic is the failure report. Helpers are `pub` for their sibling
// modules, not for anyone outside.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod browser;
mod callbacks;
mod chaos;
mod cli;
mod clients;
mod degradation;
mod disk_full;
mod docs;
mod durability;
mod export;
mod faults;
mod gemini;
mod helpers;
mod multinode;
mod node;
mod openapi;
mod ops;
mod proxy;
mod readers;
mod replay;
mod requests_list;
mod sdk_surface;
mod soak;
mod sqlite_writer;
mod startup;
mod store_conformance;
mod store_errors;
mod streams;
mod tenancy;
mod traces;
mod ui;
mod usage;
