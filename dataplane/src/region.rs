//! Memory the flow table lives in: a heap vector (tests, benches) or the mmap of a
//! `BPF_F_MMAPABLE` array map (the running dataplane), which the XDP steering program
//! reads concurrently and which outlives the process when the map is pinned.
//!
//! This module and [`crate::flow`]'s slot stores are the only `unsafe` around the flow
//! table; each block says why it is sound.

use std::ops::{Deref, DerefMut};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// A fixed-length array of `T`: on the heap or in a shared mapping.
pub struct Region<T: Copy> {
    ptr: NonNull<T>,
    len: usize,
    /// A part of a mapped region.
    mapped_part: bool,
    backing: Backing<T>,
}

enum Backing<T> {
    Heap(#[allow(dead_code)] Vec<T>),
    Mapped {
        bytes: usize,
    },
    /// A part of a region split with [`Region::split`]: the whole stays alive while any
    /// part (or a [`KeepAlive`] of it) does.
    Part(#[allow(dead_code)] KeepAlive),
}

/// Keeps the memory of a split region alive (held by its parts and by read-only views
/// other workers take of them).
#[derive(Clone)]
pub struct KeepAlive(#[allow(dead_code)] std::sync::Arc<dyn Send + Sync>);

/// The whole region behind its parts; never accessed, only dropped.
struct Whole<T: Copy>(#[allow(dead_code)] Region<T>);
// SAFETY: `Whole` is never read or written through (it only owns the memory until the
// last part is gone), so sharing it between threads shares nothing.
unsafe impl<T: Copy> Sync for Whole<T> {}
// SAFETY: as above; dropping it (unmap / free) from any thread is sound.
unsafe impl<T: Copy> Send for Whole<T> {}

// SAFETY: a `Region` owns its memory exclusively within this process (the heap vector,
// or a shared mapping of a BPF map that only this process writes and the XDP program
// only reads); `T: Copy` values carry no thread affinity. Moving it to another thread is
// as safe as moving a `Vec<T>`.
unsafe impl<T: Copy + Send> Send for Region<T> {}

impl<T: Copy> std::fmt::Debug for Region<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.backing {
            Backing::Heap(_) => "heap",
            Backing::Mapped { .. } => "mapped",
            Backing::Part(_) => "part",
        };
        write!(
            f,
            "Region({kind}, {} x {})",
            self.len,
            std::any::type_name::<T>()
        )
    }
}

impl<T: Copy + 'static> Region<T> {
    /// `len` copies of `fill` on the heap.
    pub fn heap(len: usize, fill: T) -> Self {
        Self::from_vec(vec![fill; len])
    }

    /// A heap vector's elements.
    pub fn from_vec(mut v: Vec<T>) -> Self {
        let len = v.len();
        let ptr = NonNull::new(v.as_mut_ptr()).unwrap_or(NonNull::dangling());
        Region {
            ptr,
            len,
            mapped_part: false,
            backing: Backing::Heap(v),
        }
    }

    /// Maps the values of a `BPF_F_MMAPABLE` array map with `len` entries of
    /// `value_size` bytes (the map's own sizes, as the kernel reports them).
    ///
    /// `T` must be a plain-old-data type for which every bit pattern is valid (integers
    /// and `repr(C)` structs of integers): the memory holds whatever a previous process
    /// wrote.
    pub fn map_bpf_array(
        fd: BorrowedFd<'_>,
        len: usize,
        value_size: usize,
    ) -> std::io::Result<Self> {
        let stride = value_size.div_ceil(8) * 8;
        if stride != std::mem::size_of::<T>() || std::mem::align_of::<T>() > 8 || len == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "map values are {value_size} bytes, expected {} ({})",
                    std::mem::size_of::<T>(),
                    std::any::type_name::<T>()
                ),
            ));
        }
        let page = 4096;
        let bytes = (stride * len).div_ceil(page) * page;
        // SAFETY: mmap of a BPF array map created with BPF_F_MMAPABLE; the kernel maps
        // exactly the value area (page-aligned, `stride * len` bytes rounded up to a
        // page). We ask for a fresh address (NULL hint), so no existing mapping is
        // replaced. The result is checked for MAP_FAILED below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Region {
            ptr: NonNull::new(p.cast::<T>()).ok_or_else(std::io::Error::last_os_error)?,
            len,
            mapped_part: false,
            backing: Backing::Mapped { bytes },
        })
    }

    /// Whether the memory is a shared map (read by the XDP program, kept by the kernel).
    pub fn is_mapped(&self) -> bool {
        match &self.backing {
            Backing::Mapped { .. } => true,
            Backing::Heap(_) => false,
            Backing::Part(_) => self.mapped_part,
        }
    }

    /// Splits the region into `n` equal consecutive parts (`len` must be a multiple of
    /// `n`); each part is written only through itself (one writer per part), and the
    /// memory lives until every part and every [`KeepAlive`] is gone.
    pub fn split(self, n: usize) -> Vec<Region<T>> {
        assert!(
            n > 0 && self.len.is_multiple_of(n),
            "a region splits into equal parts"
        );
        let each = self.len / n;
        let (base, mapped) = (self.ptr, self.is_mapped());
        let keep = KeepAlive(std::sync::Arc::new(Whole(self)));
        (0..n)
            .map(|i| Region {
                // SAFETY: `i * each < len`, so the offset stays inside the allocation
                // (or one past its end for an empty part, which is never dereferenced).
                ptr: unsafe { NonNull::new_unchecked(base.as_ptr().add(i * each)) },
                len: each,
                mapped_part: mapped,
                backing: Backing::Part(keep.clone()),
            })
            .collect()
    }

    /// The parts of one [`Region::split`], in order, as one region again.
    pub fn join(parts: Vec<Region<T>>) -> Region<T> {
        let first = parts.first().expect("at least one part");
        let (ptr, mapped) = (first.ptr, first.is_mapped());
        let keep = first.keep_alive().expect("parts of a split region");
        let mut len = 0;
        for p in &parts {
            assert!(
                std::ptr::eq(p.ptr.as_ptr(), ptr.as_ptr().wrapping_add(len))
                    && p.keep_alive()
                        .is_some_and(|k| std::sync::Arc::ptr_eq(&k.0, &keep.0)),
                "consecutive parts of one region"
            );
            len += p.len;
        }
        Region {
            ptr,
            len,
            mapped_part: mapped,
            backing: Backing::Part(keep),
        }
    }

    /// What keeps this part's memory alive (`None` for a whole region).
    pub fn keep_alive(&self) -> Option<KeepAlive> {
        match &self.backing {
            Backing::Part(k) => Some(k.clone()),
            _ => None,
        }
    }

    /// The first element's address, for read-only views of another worker's part
    /// (valid while a [`KeepAlive`] of it is held).
    pub fn as_ptr(&self) -> *const T {
        self.ptr.as_ptr()
    }
}

impl Region<u64> {
    /// Stores `v` at `i` as one atomic 64-bit write with release ordering: every store
    /// made before it (a flow record) is visible to a reader on another CPU that sees
    /// this one. Panics when `i` is out of bounds.
    #[inline(always)]
    pub fn store_release(&mut self, i: usize, v: u64) {
        release_store_u64(&mut self[i], v);
    }
}

/// Stores `v` into `*p` as one atomic write with release ordering (see
/// [`Region::store_release`]).
#[inline(always)]
pub fn release_store_u64(p: &mut u64, v: u64) {
    // SAFETY: `p` is a valid, aligned, exclusively borrowed `u64`, hence a valid
    // `AtomicU64` location for the duration of the call; the only concurrent accessor is
    // the XDP program, which reads it (an atomic 8-byte load on 64-bit kernels).
    let a = unsafe { AtomicU64::from_ptr(p) };
    a.store(v, Ordering::Release);
}

/// Stores `v` into `*p` as one atomic write with release ordering.
#[inline(always)]
pub fn release_store_u32(p: &mut u32, v: u32) {
    // SAFETY: as in `release_store_u64`, for a valid, aligned, exclusively borrowed u32.
    let a = unsafe { AtomicU32::from_ptr(p) };
    a.store(v, Ordering::Release);
}

impl<T: Copy> Deref for Region<T> {
    type Target = [T];
    #[inline(always)]
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` points to `len` initialised `T`s owned by this region (the heap
        // vector, or a mapping of `len` values for which every bit pattern is a valid
        // `T`), alive until `self` drops.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Copy> DerefMut for Region<T> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`; `&mut self` makes this the only Rust reference. The XDP
        // program reads the mapping concurrently, which the flow table's write ordering
        // accounts for (docs/dataplane.md, "Flow table").
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Copy> Drop for Region<T> {
    fn drop(&mut self) {
        if let Backing::Mapped { bytes } = self.backing {
            // SAFETY: unmapping exactly the mapping created in `map_bpf_array`; no
            // reference into it outlives `self`.
            unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), bytes);
            }
        }
    }
}

/// `CLOCK_MONOTONIC` in milliseconds: the flow table's clock. The XDP program reads the
/// same clock (`bpf_ktime_get_ns`), and it keeps running across a restart of the
/// process, so expiry times in a pinned table stay meaningful.
pub fn monotonic_ms() -> u64 {
    monotonic_ns() / 1_000_000
}

/// `CLOCK_MONOTONIC` in nanoseconds (the new-flow admission's clock, which the XDP
/// program reads as `bpf_ktime_get_ns`).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into the valid, exclusively borrowed
    // `ts`; CLOCK_MONOTONIC always exists on Linux.
    unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts);
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_region_reads_and_writes() {
        let mut r = Region::heap(16, 0u64);
        r[3] = 7;
        r.store_release(4, 9);
        assert_eq!(&r[3..5], &[7, 9]);
        assert!(!r.is_mapped());
    }

    #[test]
    fn split_parts_are_disjoint_and_outlive_the_whole() {
        let r = Region::from_vec((0..12u64).collect());
        let mut parts = r.split(3);
        assert_eq!(parts.len(), 3);
        assert_eq!(&parts[1][..], &[4, 5, 6, 7]);
        parts[2][0] = 99;
        let keep = parts[2].keep_alive().expect("a part");
        let p = parts[2].as_ptr();
        drop(parts);
        // SAFETY: `keep` holds the memory; index 0 of the third part was written above.
        assert_eq!(unsafe { *p }, 99);
        drop(keep);
    }

    #[test]
    fn monotonic_clock_advances() {
        let a = monotonic_ms();
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert!(monotonic_ms() >= a + 4);
    }
}
