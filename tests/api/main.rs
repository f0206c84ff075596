//! Black-box tests over real sockets: holdfast in front of the mock provider (one test binary,
//! shared helpers; see `helpers.rs`). Test names say the behaviour; comments cite SPEC ids.

mod browser;
mod chaos;
mod clients;
mod durability;
mod faults;
mod helpers;
mod multinode;
mod node;
mod openapi;
mod ops;
mod proxy;
mod sqlite_writer;
mod store_conformance;
mod store_errors;
mod streams;
mod tenancy;
