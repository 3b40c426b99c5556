//! The calling thread's CPU priority: background work (the write-back log's cleaner) runs
//! below the threads that serve clients, so that on a machine with few cores it takes the
//! CPU they leave rather than a share of theirs.

/// Sets the calling thread's nice value (-20..19; Linux keeps it per thread, and threads it
/// spawns inherit it). Raising it needs no privilege; lowering it again needs
/// `CAP_SYS_NICE` or an `RLIMIT_NICE` that allows it, and fails otherwise.
pub fn set_nice(nice: i32) -> std::io::Result<()> {
    // SAFETY: gettid and setpriority take plain integers and touch no memory of ours.
    let r = unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, nice)
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The calling thread's nice value.
pub fn nice() -> std::io::Result<i32> {
    // SAFETY: as in `set_nice`. getpriority may return -1 as a value: errno tells.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        *libc::__errno_location() = 0;
        let n = libc::getpriority(libc::PRIO_PROCESS, tid);
        if n == -1 && *libc::__errno_location() != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_thread_lowers_its_own_priority_and_its_children_inherit_it() {
        let mine = super::nice().unwrap();
        std::thread::spawn(|| {
            let before = super::nice().unwrap();
            let to = (before + 5).min(19);
            super::set_nice(to).unwrap();
            assert_eq!(super::nice().unwrap(), to);
            let child = std::thread::spawn(super::nice).join().unwrap().unwrap();
            assert_eq!(child, to);
        })
        .join()
        .unwrap();
        // The thread that spawned it kept its own.
        assert_eq!(super::nice().unwrap(), mine);
    }
}
