//! The writer's connection with its statements held beside it (issue 30).
//!
//! rusqlite's statement cache finds a statement by its SQL text: each use trims the text and
//! hashes it, and each return hashes it again, about 12 k instructions per non-stream request
//! on the writer thread, the one thread every write goes through (decision 130). The writer's
//! statements are `'static` text, so [`Tx::prepare_held`] finds each one by the text's address
//! instead, which never changes while the program runs: a short scan of the statements
//! prepared so far, each prepared once per connection and held until the writer stops.

use std::cell::{Cell, RefCell, RefMut};
use std::ops::{Deref, DerefMut};

use rusqlite::{Connection, PrepFlags, Statement};

/// Most statements held per connection; the writer has about thirty. Past it a statement is
/// prepared for each use.
const SLOTS: usize = 64;

/// The writer's connection with the statements it holds, made once per writer thread and
/// kept across its group commits. Dereferences to the [`Connection`], so code that needs
/// nothing held takes it as one.
pub(super) struct Tx<'c> {
    conn: &'c Connection,
    /// Made whole at the start, so a statement in use is never moved.
    slots: Vec<Slot<'c>>,
}

/// Where one statement is held.
struct Slot<'c> {
    /// The address and length of its SQL text; [`FREE`] before a statement takes the slot.
    sql: Cell<(usize, usize)>,
    stmt: RefCell<Option<Statement<'c>>>,
}

/// A slot no statement has taken yet.
const FREE: (usize, usize) = (0, 0);

impl<'c> Tx<'c> {
    pub(super) fn new(conn: &'c Connection) -> Tx<'c> {
        Tx {
            conn,
            slots: (0..SLOTS)
                .map(|_| Slot {
                    sql: Cell::new(FREE),
                    stmt: RefCell::new(None),
                })
                .collect(),
        }
    }

    /// The statement of `sql`, prepared on the first call and held for the next. A statement
    /// already in use (the same SQL asked for again before the first is dropped) is prepared
    /// anew for this use.
    ///
    /// # Errors
    /// What preparing `sql` fails with.
    pub(super) fn prepare_held(&self, sql: &'static str) -> rusqlite::Result<Held<'_, 'c>> {
        let key = (sql.as_ptr() as usize, sql.len());
        let slot = self.slots.iter().find(|slot| {
            let at = slot.sql.get();
            at == key || at == FREE
        });
        if let Some(slot) = slot {
            slot.sql.set(key);
        }
        let Some(mut stmt) = slot.and_then(|slot| slot.stmt.try_borrow_mut().ok()) else {
            return Ok(Held::Own(self.conn.prepare(sql)?));
        };
        if stmt.is_none() {
            // As rusqlite's cache prepares them: a statement kept for good stays out of
            // SQLite's lookaside memory, which would otherwise run short for every statement's
            // own allocations (measured: held statements prepared without it stepped slower).
            *stmt = Some(
                self.conn
                    .prepare_with_flags(sql, PrepFlags::SQLITE_PREPARE_PERSISTENT)?,
            );
        }
        match RefMut::filter_map(stmt, Option::as_mut) {
            Ok(stmt) => Ok(Held::Slot(stmt)),
            Err(_) => Ok(Held::Own(self.conn.prepare(sql)?)),
        }
    }
}

impl<'c> Deref for Tx<'c> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        self.conn
    }
}

/// A statement of [`Tx::prepare_held`]: held in its slot until dropped, or prepared for this
/// use alone. rusqlite resets a statement after each `execute` and once its rows are dropped,
/// so a held one is ready for the next use; its values are let go of when it is given back.
pub(super) enum Held<'t, 'c> {
    Slot(RefMut<'t, Statement<'c>>),
    Own(Statement<'c>),
}

impl Drop for Held<'_, '_> {
    fn drop(&mut self) {
        // As rusqlite's cache does: a held statement would otherwise keep a copy of what was
        // last bound to it (a request's body, up to `max_body_bytes`) for as long as the
        // writer runs, also after the request is pruned.
        if let Held::Slot(stmt) = self {
            stmt.clear_bindings();
        }
    }
}

impl<'c> Deref for Held<'_, 'c> {
    type Target = Statement<'c>;

    fn deref(&self) -> &Statement<'c> {
        match self {
            Held::Slot(stmt) => stmt,
            Held::Own(stmt) => stmt,
        }
    }
}

impl<'c> DerefMut for Held<'_, 'c> {
    fn deref_mut(&mut self) -> &mut Statement<'c> {
        match self {
            Held::Slot(stmt) => stmt,
            Held::Own(stmt) => stmt,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_statement_is_prepared_once_and_held_and_a_second_use_at_once_gets_its_own_decision130() {
        let conn = Connection::open_in_memory().expect("open");
        conn.execute_batch("CREATE TABLE t (n INTEGER)")
            .expect("create");
        let tx = Tx::new(&conn);
        const INSERT: &str = "INSERT INTO t (n) VALUES (?1)";
        for n in 0..3 {
            tx.prepare_held(INSERT)
                .expect("prepare")
                .execute([n])
                .expect("insert");
        }
        let used = || {
            tx.slots
                .iter()
                .filter(|slot| slot.sql.get() != FREE)
                .count()
        };
        assert_eq!(used(), 1, "one statement, held");
        {
            let mut first = tx.prepare_held(INSERT).expect("prepare");
            let mut second = tx.prepare_held(INSERT).expect("prepare anew");
            assert!(matches!(first, Held::Slot(_)) && matches!(second, Held::Own(_)));
            first.execute([10]).expect("insert");
            second.execute([11]).expect("insert");
        }
        assert_eq!(used(), 1);
        let again = tx.prepare_held(INSERT).expect("prepare");
        assert!(matches!(again, Held::Slot(_)), "given back");
        assert_eq!(
            again.expanded_sql().as_deref(),
            Some("INSERT INTO t (n) VALUES (NULL)"),
            "what was bound to it was let go of"
        );
        drop(again);
        const COUNT: &str = "SELECT count(*), sum(n) FROM t";
        let counted: (i64, i64) = tx
            .prepare_held(COUNT)
            .expect("prepare")
            .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))
            .expect("count");
        assert_eq!(counted, (5, 24));
        // Its rows were read and dropped: the statement was reset and runs again.
        let again: i64 = tx
            .prepare_held(COUNT)
            .expect("prepare")
            .query_row([], |r| r.get(0))
            .expect("count");
        assert_eq!(again, 5);
    }
}
