//! Which records of a fixed-capacity table hold an entry, one bit each: a sweep over a
//! table that is mostly free covers 64 free records with one word read instead of
//! reading each record (a 1 M-record IPv4 table is 32 MiB of records and 128 KiB of
//! bits).
//!
//! Owned by the table that sets and clears the bits (the flow tables); it must agree with
//! the records: a bit is set exactly while its record holds an entry.

/// One bit per record.
#[derive(Debug, Clone)]
pub struct Occupied {
    words: Vec<u64>,
    records: usize,
}

impl Occupied {
    /// No record occupied among `records`.
    pub fn new(records: usize) -> Self {
        Occupied {
            words: vec![0; records.div_ceil(64)],
            records,
        }
    }

    /// Record `id` holds an entry now.
    #[inline]
    pub fn set(&mut self, id: usize) {
        self.words[id / 64] |= 1 << (id % 64);
    }

    /// Record `id` is free now.
    #[inline]
    pub fn clear(&mut self, id: usize) {
        self.words[id / 64] &= !(1 << (id % 64));
    }

    /// Every record free.
    pub fn clear_all(&mut self) {
        self.words.fill(0);
    }

    /// Bytes the bits take.
    pub fn bytes(&self) -> usize {
        self.words.len() * 8
    }

    /// The next stretch of a sweep that still has `left` (≥ 1) records to cover from
    /// `*cursor` (< the table's records): the records up to the end of the cursor's word,
    /// of `left` or of the table, whichever comes first. Moves the cursor past them
    /// (wrapping at the table's end), takes them off `left`, and returns the occupied ones
    /// among them, in order (a copy of their word: the caller may free them as it goes).
    /// A sweep walks a free stretch at one word a step.
    #[inline]
    pub fn stretch(&self, cursor: &mut usize, left: &mut usize) -> Ones {
        let c = *cursor;
        let base = c / 64 * 64;
        let end = (base + 64).min(c + *left).min(self.records);
        let mut bits = self.words[base / 64] & (u64::MAX << (c - base));
        if end - base < 64 {
            bits &= (1 << (end - base)) - 1;
        }
        *left -= end - c;
        *cursor = if end >= self.records { 0 } else { end };
        Ones { bits, base }
    }
}

/// The occupied records of one stretch ([`Occupied::stretch`]), lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ones {
    bits: u64,
    base: usize,
}

impl Iterator for Ones {
    type Item = usize;

    #[inline]
    fn next(&mut self) -> Option<usize> {
        if self.bits == 0 {
            return None;
        }
        let id = self.base + self.bits.trailing_zeros() as usize;
        self.bits &= self.bits - 1;
        Some(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_stretch_ends_at_its_word_its_budget_or_the_table() {
        let mut o = Occupied::new(200);
        o.set(3);
        o.set(70);
        o.set(199);
        let ids =
            |o: &Occupied, c: &mut usize, left: &mut usize| o.stretch(c, left).collect::<Vec<_>>();
        let (mut c, mut left) = (2, 500);
        assert_eq!(ids(&o, &mut c, &mut left), [3]);
        assert_eq!((c, left), (64, 438));
        assert_eq!(ids(&o, &mut c, &mut left), [70]);
        let (mut c, mut left) = (60, 3);
        assert!(
            ids(&o, &mut c, &mut left).is_empty(),
            "63 and beyond not covered"
        );
        assert_eq!((c, left), (63, 0));
        let (mut c, mut left) = (192, 100);
        assert_eq!(ids(&o, &mut c, &mut left), [199]);
        assert_eq!((c, left), (0, 92), "wrapped at the table's end");
        o.clear(70);
        let (mut c, mut left) = (0, 200);
        let mut all = Vec::new();
        while left > 0 {
            all.extend(o.stretch(&mut c, &mut left));
        }
        assert_eq!(all, [3, 199]);
    }

    proptest! {
        /// A sweep sees exactly the occupied records of the stretch it covers, in order,
        /// and its cursor moves by the budget, wrapping.
        #[test]
        fn a_sweep_by_stretches_sees_what_a_record_by_record_walk_sees(
            records in 1usize..400,
            set in proptest::collection::vec(0usize..400, 0..60),
            cursor in 0usize..400,
            budget in 0usize..900,
        ) {
            let mut o = Occupied::new(records);
            let mut plain = vec![false; records];
            for &i in set.iter().filter(|&&i| i < records) {
                o.set(i);
                plain[i] = true;
            }
            let start = cursor % records;
            let mut want = Vec::new();
            let mut c = start;
            for _ in 0..budget.min(records) {
                if plain[c] {
                    want.push(c as u32);
                }
                c = (c + 1) % records;
            }
            let (mut got, mut cur, mut left) = (Vec::new(), start, budget.min(records));
            while left > 0 {
                got.extend(o.stretch(&mut cur, &mut left).map(|id| id as u32));
            }
            prop_assert_eq!(got, want);
            prop_assert_eq!(cur, c);
        }
    }
}
