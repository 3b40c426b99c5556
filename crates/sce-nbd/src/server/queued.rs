//! Requests of an export with an I/O queue ([`Export::io`], io_uring on a local file or
//! block device): the reader submits reads, writes and flushes to the queue itself (in
//! batches, when the client pipelines), and the queue's completion thread sends the reply. No worker is involved, so a connection keeps
//! as many requests in flight on the device as it sends (up to its queue depth), with no
//! hand-off between threads on the way in.
//!
//! Everything else (trims, write-zeroes, cache, an export without a queue) goes to the
//! workers as before.

use super::errors::errno_of;
use super::exec::check;
use super::transmission::{Job, Session, Ticket};
use super::worker::{answer, may_run};
use super::*;
use sce_io::{IoOp, IoQueue, OnDone, QueuedReads};

/// Operations prepared by a connection's reader and not yet submitted: submitted together
/// (one system call for the lot on io_uring, and one doorbell for the device) when no
/// further request is buffered, or before the reader could block.
#[derive(Default)]
pub(super) struct Batch {
    ops: Vec<(IoOp, OnDone)>,
    /// The queue they go to when the device named it (a started write), rather than the
    /// export's: asking the export may block, which a started write must not wait on.
    queue: Option<Arc<dyn IoQueue>>,
}

/// Most operations submitted at once.
const BATCH_MAX: usize = 64;

impl Batch {
    /// Submits what is batched, to the queue of the connection's export.
    pub(super) fn submit(&mut self, conn: &Session) {
        let named = self.queue.take();
        if self.ops.is_empty() {
            return;
        }
        let q = match (named, &conn.export.io) {
            (Some(q), _) => Some(q),
            (None, Some(ExportIo::Queue(q))) => Some(q.clone()),
            (None, Some(ExportIo::Reads(r))) => r.queue(),
            (None, None) => None,
        };
        match q {
            Some(q) => q.submit_batch(std::mem::take(&mut self.ops)),
            // Cannot happen: only an export with a queue batches. Run them where they are.
            None => {
                for (op, done) in self.ops.drain(..) {
                    let what = op.op();
                    done(sce_io::IoDone {
                        result: Err(sce_io::IoError::Invalid(format!(
                            "internal: no queue for a {what:?}"
                        ))),
                        buf: op.into_buf(),
                    });
                }
            }
        }
    }

    /// Adds a started operation that goes to queue `q` (submitting first what is batched
    /// for another queue).
    fn push_to(&mut self, q: Arc<dyn IoQueue>, op: IoOp, done: OnDone, conn: &Session) {
        let same = |a: &Arc<dyn IoQueue>| std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(&q));
        if self.queue.as_ref().is_some_and(|a| !same(a)) {
            self.submit(conn);
        }
        self.queue = Some(q);
        self.ops.push((op, done));
        if self.ops.len() >= BATCH_MAX {
            self.submit(conn);
        }
    }
}

/// Prepares `job` for its export's queue and adds it to `batch` (or answers it at once if it
/// may not run), or gives it back for the workers.
/// `alone`: the request may run on the calling thread (see `reader::alone`).
pub(super) fn prepare(
    shared: &Shared,
    job: Job,
    batch: &mut Batch,
    alone: bool,
) -> Result<(), Job> {
    let (dev, req) = (&*job.conn.export.device, &job.req);
    if job.conn.byte_granular && super::unaligned::is_unaligned(dev, req.offset, req.len as u64) {
        // Served by read-modify-write (`unaligned.rs`), by a worker.
        return Err(job);
    }
    let q = match &job.conn.export.io {
        Some(ExportIo::Queue(q)) => q.clone(),
        Some(ExportIo::Reads(r)) if job.req.command == proto::CMD_READ => {
            let r = r.clone();
            return start_read(shared, &*r, job, batch, alone);
        }
        // Not FUA: a cached volume's FUA is its own flush (a commit), on a worker.
        Some(ExportIo::Reads(r))
            if job.req.command == proto::CMD_WRITE && job.req.flags & proto::CMD_FLAG_FUA == 0 =>
        {
            let r = r.clone();
            return start_write(shared, &*r, job, batch);
        }
        _ => return Err(job),
    };
    let read = match job.req.command {
        proto::CMD_READ => true,
        proto::CMD_WRITE | proto::CMD_FLUSH => false,
        _ => return Err(job),
    };
    let Job {
        conn,
        req,
        payload,
        ticket,
    } = job;
    if let Err(code) = may_run(shared, &conn).and_then(|()| check(&conn, &req)) {
        answer(&conn, &req, Err(code), ticket);
        return Ok(());
    }
    let op = match req.command {
        proto::CMD_READ => IoOp::Read {
            offset: req.offset,
            buf: shared.pool.take(req.len as usize),
        },
        proto::CMD_WRITE => match payload {
            Some(buf) => IoOp::Write {
                offset: req.offset,
                buf,
            },
            None => {
                answer(&conn, &req, Err(errno::EINVAL), ticket);
                return Ok(());
            }
        },
        _ => IoOp::Flush,
    };
    shared.stats.queued_requests.fetch_add(1, Relaxed);
    let fua = req.command == proto::CMD_WRITE && req.flags & proto::CMD_FLAG_FUA != 0;
    let q2 = q.clone();
    let session = conn.clone();
    batch.ops.push((
        op,
        Box::new(move |done| match done.result {
            Err(e) => answer(&conn, &req, Err(errno_of(&e, !read)), ticket),
            // FUA: the write is acknowledged once a flush after its completion is done.
            Ok(()) if fua => flush_then_answer(&*q2, conn, req, ticket),
            Ok(()) => {
                let data = if read { done.buf } else { None };
                answer(&conn, &req, Ok(data), ticket)
            }
        }),
    ));
    if batch.ops.len() >= BATCH_MAX {
        batch.submit(&session);
    }
    Ok(())
}

fn flush_then_answer(q: &dyn IoQueue, conn: Arc<Session>, req: Request, ticket: Ticket) {
    q.submit(
        IoOp::Flush,
        Box::new(move |done| {
            let r = done.result.map(|()| None).map_err(|e| errno_of(&e, true));
            answer(&conn, &req, r, ticket)
        }),
    );
}

/// A read of a device that serves some reads from a queue (a cached volume's hits): started
/// here and answered from its completion, or given back for the workers.
fn start_read(
    shared: &Shared,
    r: &dyn QueuedReads,
    job: Job,
    batch: &mut Batch,
    alone: bool,
) -> Result<(), Job> {
    if let Err(code) = may_run(shared, &job.conn).and_then(|()| check(&job.conn, &job.req)) {
        answer(&job.conn, &job.req, Err(code), job.ticket);
        return Ok(());
    }
    let Some(start) = r.start_read(job.req.offset, job.req.len as u64) else {
        return Err(job);
    };
    let Job {
        conn, req, ticket, ..
    } = job;
    let session = conn.clone();
    let (op, done) = start(
        shared.pool.take(req.len as usize),
        Box::new(move |done| {
            let r = match done.result {
                Ok(()) => Ok(done.buf),
                Err(e) => Err(errno_of(&e, false)),
            };
            answer(&conn, &req, r, ticket)
        }),
    );
    if let (true, Some(q)) = (alone, r.queue()) {
        shared.stats.inline_requests.fetch_add(1, Relaxed);
        q.run_here(op, done);
        return Ok(());
    }
    shared.stats.queued_requests.fetch_add(1, Relaxed);
    batch.ops.push((op, done));
    if batch.ops.len() >= BATCH_MAX {
        batch.submit(&session);
    }
    Ok(())
}

/// A write of a device that starts some writes without blocking (a cached volume in
/// write-back through the log): started here, submitted with the batch to the queue the
/// device named, and answered from its completion; or given back for the workers.
fn start_write(
    shared: &Shared,
    r: &dyn QueuedReads,
    job: Job,
    batch: &mut Batch,
) -> Result<(), Job> {
    if let Err(code) = may_run(shared, &job.conn).and_then(|()| check(&job.conn, &job.req)) {
        answer(&job.conn, &job.req, Err(code), job.ticket);
        return Ok(());
    }
    let len = job.req.len as u64;
    let payload_fits = job.payload.as_ref().is_some_and(|b| b.len() as u64 == len);
    let started = payload_fits
        .then(|| r.start_write(job.req.offset, len))
        .flatten();
    let Some((start, q)) = started else {
        return Err(job);
    };
    let Job {
        conn,
        req,
        payload,
        ticket,
    } = job;
    let session = conn.clone();
    let (op, done) = start(
        payload.expect("checked above"),
        Box::new(move |done| {
            let r = done.result.map(|()| None).map_err(|e| errno_of(&e, true));
            answer(&conn, &req, r, ticket)
        }),
    );
    shared.stats.queued_requests.fetch_add(1, Relaxed);
    batch.push_to(q, op, done, &session);
    Ok(())
}
