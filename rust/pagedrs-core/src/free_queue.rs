//! Intrusive doubly linked list of free blocks over an index array.
//!
//! Node 0 is the sentinel of a circular list; block `b` is node `b + 1`. A node that is not in the
//! queue has `next == NIL`, so membership, removal from the middle, push and pop are all O(1).
//! Each node also carries the pool's per-block state (ref count, cached flag), so allocating or
//! freeing a block touches one 16-byte record instead of several arrays.

use crate::BlockId;

const NIL: u32 = u32::MAX;
const SENTINEL: usize = 0;

#[derive(Debug, Clone)]
pub struct FreeQueue {
    nodes: Vec<Node>,
    len: usize,
}

/// One block's record: free-list links plus the owner's per-block state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Node {
    prev: u32,
    next: u32,
    pub ref_cnt: u32,
    pub cached: bool,
}

const EMPTY: Node = Node {
    prev: NIL,
    next: NIL,
    ref_cnt: 0,
    cached: false,
};

impl FreeQueue {
    /// A queue holding blocks `0..num_blocks` in ascending order.
    pub fn new(num_blocks: usize) -> Self {
        let sentinel = Node {
            prev: SENTINEL as u32,
            next: SENTINEL as u32,
            ref_cnt: 0,
            cached: false,
        };
        let mut q = Self {
            nodes: vec![sentinel],
            len: 0,
        };
        q.grow(num_blocks);
        for b in 0..num_blocks {
            q.push_back(BlockId(b as u32));
        }
        q
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of blocks the queue can index.
    pub fn capacity(&self) -> usize {
        self.nodes.len() - 1
    }

    pub fn contains(&self, b: BlockId) -> bool {
        self.nodes[b.node()].next != NIL
    }

    /// The record of block `b`.
    pub fn node(&self, b: BlockId) -> &Node {
        &self.nodes[b.node()]
    }

    pub fn node_mut(&mut self, b: BlockId) -> &mut Node {
        &mut self.nodes[b.node()]
    }

    pub fn front(&self) -> Option<BlockId> {
        let n = self.nodes[SENTINEL].next as usize;
        (n != SENTINEL).then(|| BlockId::from_node(n))
    }

    pub fn push_back(&mut self, b: BlockId) {
        let last = self.nodes[SENTINEL].prev as usize;
        self.link(last, b.node(), SENTINEL);
    }

    pub fn push_front(&mut self, b: BlockId) {
        let first = self.nodes[SENTINEL].next as usize;
        self.link(SENTINEL, b.node(), first);
    }

    pub fn pop_front(&mut self) -> Option<BlockId> {
        let b = self.front()?;
        self.remove(b);
        Some(b)
    }

    /// Removes `b` from anywhere in the queue. Panics (debug) if `b` is not queued.
    pub fn remove(&mut self, b: BlockId) {
        let n = b.node();
        debug_assert!(
            self.nodes[n].next != NIL,
            "block {} is not in the free queue",
            b.0
        );
        let (p, nx) = (self.nodes[n].prev as usize, self.nodes[n].next as usize);
        self.nodes[p].next = nx as u32;
        self.nodes[nx].prev = p as u32;
        self.nodes[n].prev = NIL;
        self.nodes[n].next = NIL;
        self.len -= 1;
    }

    /// Makes room for blocks up to `num_blocks`; the new blocks are not queued.
    pub fn grow(&mut self, num_blocks: usize) {
        self.nodes.resize(num_blocks + 1, EMPTY);
    }

    /// Drops blocks `num_blocks..`; none of them may be queued.
    pub fn truncate(&mut self, num_blocks: usize) {
        debug_assert!(self.nodes[num_blocks + 1..].iter().all(|l| l.next == NIL));
        self.nodes.truncate(num_blocks + 1);
    }

    /// Blocks from front (next to be reused) to back.
    pub fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        let mut n = self.nodes[SENTINEL].next as usize;
        std::iter::from_fn(move || {
            if n == SENTINEL || n == NIL as usize {
                return None;
            }
            let b = BlockId::from_node(n);
            n = self.nodes[n].next as usize;
            Some(b)
        })
    }

    fn link(&mut self, p: usize, n: usize, nx: usize) {
        debug_assert!(
            self.nodes[n].next == NIL,
            "block {} is already in the free queue",
            n - 1
        );
        self.nodes[p].next = n as u32;
        self.nodes[n].prev = p as u32;
        self.nodes[n].next = nx as u32;
        self.nodes[nx].prev = n as u32;
        self.len += 1;
    }
}

impl BlockId {
    fn node(self) -> usize {
        self.0 as usize + 1
    }

    fn from_node(n: usize) -> Self {
        BlockId((n - 1) as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(q: &FreeQueue) -> Vec<u32> {
        q.iter().map(|b| b.0).collect()
    }

    #[test]
    fn new_queue_is_ascending() {
        let q = FreeQueue::new(4);
        assert_eq!(ids(&q), vec![0, 1, 2, 3]);
        assert_eq!(q.len(), 4);
    }

    #[test]
    fn pop_push_remove() {
        let mut q = FreeQueue::new(5);
        assert_eq!(q.pop_front(), Some(BlockId(0)));
        q.remove(BlockId(2));
        assert!(!q.contains(BlockId(2)));
        q.push_back(BlockId(2));
        q.push_front(BlockId(0));
        assert_eq!(ids(&q), vec![0, 1, 3, 4, 2]);
        q.remove(BlockId(4));
        q.remove(BlockId(0));
        assert_eq!(ids(&q), vec![1, 3, 2]);
        assert_eq!(q.len(), 3);
    }

    #[test]
    fn drain_to_empty() {
        let mut q = FreeQueue::new(3);
        while q.pop_front().is_some() {}
        assert!(q.is_empty());
        assert_eq!(q.front(), None);
        q.push_back(BlockId(1));
        assert_eq!(ids(&q), vec![1]);
    }

    #[test]
    fn grow_and_truncate() {
        let mut q = FreeQueue::new(2);
        q.grow(4);
        assert_eq!(q.capacity(), 4);
        q.push_back(BlockId(3));
        assert_eq!(ids(&q), vec![0, 1, 3]);
        q.remove(BlockId(3));
        q.truncate(3);
        assert_eq!(q.capacity(), 3);
        assert_eq!(ids(&q), vec![0, 1]);
    }
}
