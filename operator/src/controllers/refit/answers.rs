//! Which RefitRequests this replica knows to be answered, so that a reconcile can trust its
//! cache's "Pending" without reading the request again from the API server.
//!
//! The controller decides on a watch cache. A cache that lags an answer must never lead to a
//! second decision: the commit is written before the answer, so a second decision could move a
//! reservation whose request was already refused (or moved differently). Two writers can have
//! answered a request behind the cache's back:
//! - **this replica**, in an earlier reconcile: every reconcile that may commit marks the request
//!   *uncertain* before it decides, and only an answer the API server accepted marks it
//!   *answered*. Anything in between (a commit whose answer was lost, a timeout, a conflict)
//!   leaves it uncertain, and an uncertain request is read again before it is decided.
//! - **another replica**, while it led: leadership passes only after the old leader stopped
//!   writing (lease/leader.rs), so each of our terms starts with one quorum list of the
//!   requests; those it shows answered are recorded. A request that is neither recorded nor
//!   uncertain was pending when the term started, or was created after, and only this leader
//!   has answered since.
//!
//! Records are facts about a request's UID, so they outlive the term they were made in (an
//! answer written late by a reconcile from our previous term still counts). They are dropped
//! once the request must have been deleted (`--refit-ttl` after its answer, with room to spare).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What the book says of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// This term has not listed the requests yet: list them ([`AnswerBook::start_term`]) first.
    TermNotStarted,
    /// Answered (by us, or before this term by another replica): nothing to decide.
    Answered,
    /// A reconcile of ours may have committed or answered it without confirmation: read the
    /// request from the API server before deciding.
    Uncertain,
    /// Only this leader can have answered it, and it has not: the cache's Pending is true.
    Pending,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Record {
    Answered,
    Uncertain,
}

#[derive(Default)]
struct Book {
    /// The term whose start list has been recorded.
    listed_term: Option<u64>,
    records: HashMap<String, (Record, Instant)>,
    last_prune: Option<Instant>,
}

/// The records, shared by the refit reconciles.
pub struct AnswerBook {
    book: Mutex<Book>,
    /// How long a record is kept after it was last written.
    keep: Duration,
}

impl AnswerBook {
    /// A book whose records live `keep` (longer than an answered request stays).
    pub fn new(keep: Duration) -> Self {
        AnswerBook {
            book: Mutex::default(),
            keep,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Book> {
        // Every update is a single insert: the map is consistent after a panic elsewhere.
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The standing of request `uid` in leadership term `term`.
    pub fn standing(&self, term: u64, uid: &str) -> Standing {
        let book = self.lock();
        if book.listed_term != Some(term) {
            return Standing::TermNotStarted;
        }
        match book.records.get(uid) {
            Some((Record::Answered, _)) => Standing::Answered,
            Some((Record::Uncertain, _)) => Standing::Uncertain,
            None => Standing::Pending,
        }
    }

    /// Records term `term`'s start list: the UIDs of the requests it showed answered.
    pub fn start_term(&self, term: u64, answered: impl IntoIterator<Item = String>) {
        let now = Instant::now();
        let mut book = self.lock();
        for uid in answered {
            book.records.insert(uid, (Record::Answered, now));
        }
        book.listed_term = Some(term);
    }

    /// A reconcile is about to decide `uid` (and may commit).
    pub fn deciding(&self, uid: &str) {
        self.record(uid, Record::Uncertain);
    }

    /// The API server holds an answer for `uid`.
    pub fn answered(&self, uid: &str) {
        self.record(uid, Record::Answered);
    }

    fn record(&self, uid: &str, record: Record) {
        let now = Instant::now();
        let mut book = self.lock();
        book.records.insert(uid.to_string(), (record, now));
        // Prune now and then, not on every write.
        if book
            .last_prune
            .is_none_or(|t| now.duration_since(t) >= self.keep / 4)
        {
            let keep = self.keep;
            book.records
                .retain(|_, (_, at)| now.duration_since(*at) < keep);
            book.last_prune = Some(now);
        }
    }

    /// How many requests are recorded.
    pub fn len(&self) -> usize {
        self.lock().records.len()
    }

    /// Whether nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_trusted_before_the_term_is_listed_and_only_a_confirmed_answer_is_final() {
        let book = AnswerBook::new(Duration::from_secs(600));
        // Term 1 not listed: whatever the cache shows needs the list first.
        assert_eq!(book.standing(1, "a"), Standing::TermNotStarted);
        book.start_term(1, ["old".to_string()]);
        assert_eq!(book.standing(1, "old"), Standing::Answered);
        assert_eq!(book.standing(1, "a"), Standing::Pending);
        // Deciding marks it uncertain until the answer is confirmed.
        book.deciding("a");
        assert_eq!(book.standing(1, "a"), Standing::Uncertain);
        book.answered("a");
        assert_eq!(book.standing(1, "a"), Standing::Answered);
        // A reconcile that ended without a confirmed answer leaves its request uncertain.
        book.deciding("b");
        assert_eq!(book.standing(1, "b"), Standing::Uncertain);
        // A new term (another replica may have led in between) is listed again; our own
        // records stay, including the uncertain one.
        assert_eq!(book.standing(2, "a"), Standing::TermNotStarted);
        book.start_term(2, std::iter::empty());
        assert_eq!(book.standing(2, "a"), Standing::Answered);
        assert_eq!(book.standing(2, "b"), Standing::Uncertain);
        assert_eq!(book.standing(2, "c"), Standing::Pending);
    }

    #[test]
    fn records_are_dropped_once_the_request_is_long_gone() {
        let book = AnswerBook::new(Duration::from_millis(20));
        book.start_term(1, std::iter::empty());
        book.answered("a");
        std::thread::sleep(Duration::from_millis(30));
        // The next write prunes what is older than the keep.
        book.answered("b");
        assert_eq!(book.len(), 1);
        assert_eq!(book.standing(1, "b"), Standing::Answered);
    }
}
