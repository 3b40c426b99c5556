//! Workers run requests; replies go out from the worker when the socket takes them at once,
//! else from the connection's writer thread (`send.rs`).

use super::exec::execute;
use super::send::send_now;
use super::transmission::{Reply, Session, Ticket};
use super::*;

/// A worker: runs jobs of any connection until the server is dropped.
pub(super) fn work(shared: &Shared, queue: &JobQueue) {
    while let Some(job) = queue.pop() {
        let conn = job.conn.clone();
        let req = job.req;
        let (result, ticket) = run_job(shared, job);
        answer(&conn, &req, result, ticket);
    }
}

/// Runs a request on the calling thread (the connection's reader) and answers it.
pub(super) fn run_inline(shared: &Shared, job: Job) {
    shared.stats.inline_requests.fetch_add(1, Relaxed);
    let conn = job.conn.clone();
    let req = job.req;
    let (result, ticket) = run_job(shared, job);
    answer(&conn, &req, result, ticket);
}

/// Whether a request may still run: not during a shutdown, nor for a connection that died
/// (nobody would read the reply).
pub(super) fn may_run(shared: &Shared, conn: &Session) -> Result<(), u32> {
    if shared.shutting_down() {
        Err(errno::ESHUTDOWN)
    } else if conn.state.dead.load(Relaxed) {
        Err(errno::EIO)
    } else {
        Ok(())
    }
}

/// Runs one request into its result.
fn run_job(shared: &Shared, job: Job) -> (Result<Option<PooledBuf>, u32>, Ticket) {
    let Job {
        conn,
        req,
        payload,
        ticket,
    } = job;
    let r = may_run(shared, &conn).and_then(|()| execute(&conn, &req, payload, &shared.pool));
    (r, ticket)
}

/// Sends a request's reply: at once from this thread when that needs no waiting (the
/// common case: no hand-off to the writer thread), else through the writer.
pub(super) fn answer(
    conn: &Session,
    req: &Request,
    result: Result<Option<PooledBuf>, u32>,
    ticket: Ticket,
) {
    let reply = Reply::new(conn, req, result, ticket);
    if let Some(todo) = send_now(&conn.shared, &conn.out, &conn.state, reply) {
        conn.to_writer(todo);
    }
}
