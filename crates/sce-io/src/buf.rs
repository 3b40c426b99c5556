//! `AlignedBuf`: an owned, zeroed heap buffer with a chosen alignment, as O_DIRECT needs.

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Alignment that satisfies O_DIRECT on every device sce supports.
pub const DIRECT_IO_ALIGN: usize = 4096;

/// An owned, zero-initialised buffer whose address is a multiple of its alignment.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    align: usize,
}

// SAFETY: the buffer owns its memory exclusively, like a `Vec<u8>`.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only allow reads, like `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes aligned to 4096.
    pub fn new(len: usize) -> Self {
        Self::with_alignment(len, DIRECT_IO_ALIGN)
    }

    /// A zeroed buffer of `len` bytes aligned to `align` (a power of two).
    pub fn with_alignment(len: usize, align: usize) -> Self {
        assert!(
            align.is_power_of_two(),
            "alignment {align} is not a power of two"
        );
        if len == 0 {
            // A dangling pointer with the right alignment: never dereferenced for len 0.
            let ptr = NonNull::new(align as *mut u8).expect("align is non-zero");
            return AlignedBuf { ptr, len, align };
        }
        let layout = Layout::from_size_align(len, align).expect("valid layout");
        // SAFETY: `layout` has a non-zero size.
        let p = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len, align }
    }

    /// The alignment.
    pub fn alignment(&self) -> usize {
        self.align
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialised bytes (zeroed at allocation), or
        // dangling-but-aligned with `len == 0`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Clone for AlignedBuf {
    fn clone(&self) -> Self {
        let mut b = AlignedBuf::with_alignment(self.len, self.align);
        b.copy_from_slice(self);
        b
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("align", &self.align)
            .finish()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len != 0 {
            let layout = Layout::from_size_align(self.len, self.align).expect("valid layout");
            // SAFETY: allocated in `with_alignment` with this very layout.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        for len in [0usize, 1, 4096, 65536 + 512] {
            let b = AlignedBuf::new(len);
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % 4096, 0);
            assert!(b.iter().all(|&x| x == 0));
            let c = b.clone();
            assert_eq!(&c[..], &b[..]);
        }
    }
}
