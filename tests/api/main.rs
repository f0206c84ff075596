//! Black-box tests over real sockets: holdfast in front of the mock provider (one test binary,
//! shared helpers; see `helpers.rs`). Test names say the behaviour; comments cite SPEC ids.

mod clients;
mod durability;
mod helpers;
mod openapi;
mod ops;
mod proxy;
mod streams;
mod tenancy;
