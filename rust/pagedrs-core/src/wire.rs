//! A [`StepPlan`] as two `i64` buffers, for the one broadcast per step from the tensor-parallel
//! driver (rank 0, which schedules) to the other ranks. Built from the plan struct itself, so a
//! field added to the plan travels without a second declaration of the format.
//!
//! Header (fixed length [`WIRE_HEADER_LEN`]): `[op, payload length, scalars.., one length per
//! array..]`; op 1 = execute (other ops are the driver's control messages and use only the header).
//! Payload: every array of the plan (the KV-cache groups' tables, slot mappings and copy-on-write
//! pairs included), then the dense `[B, max_blocks]` block tables (the other ranks have no
//! persistent table), then the extra logits rows (prompt logprobs), concatenated.

use crate::error::{Error, Result};
use crate::plan::StepPlan;

/// The opcode of a step plan in the header's first slot.
pub const OP_EXECUTE: i64 = 1;

const NUM_SCALARS: usize = 6; // step_id, num_blocks, num_prefill, num_decode, num_tokens, max_blocks
const NUM_ARRAYS: usize = 32; // the plan's 30 arrays, block tables, extra logits rows

/// Length of the header of every message on the step channel.
pub const WIRE_HEADER_LEN: usize = 2 + NUM_SCALARS + NUM_ARRAYS;

/// What a non-driver rank receives: the plan, its dense block tables and the extra logits rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WirePlan {
    pub plan: StepPlan,
    /// `[B, plan.max_blocks]`, row-major, padded with 0.
    pub block_tables: Vec<i32>,
    pub extra_logits_indices: Vec<i64>,
}

fn i32s(v: &[i32]) -> impl Iterator<Item = i64> + '_ {
    v.iter().map(|&x| i64::from(x))
}

fn narrow(name: &str, v: &[i64]) -> Result<Vec<i32>> {
    v.iter()
        .map(|&x| {
            i32::try_from(x).map_err(|_| {
                Error::InvalidRequest(format!("step wire: {name} value {x} overflows i32"))
            })
        })
        .collect()
}

fn count(name: &str, x: i64) -> Result<usize> {
    usize::try_from(x)
        .map_err(|_| Error::InvalidRequest(format!("step wire: {name} is negative ({x})")))
}

/// The group arrays of a received plan add up to its groups, tokens and rows.
fn check_groups(p: &StepPlan) -> Result<()> {
    let g = p.num_groups();
    let pairs: i64 = p.group_num_copies.iter().map(|&c| i64::from(c)).sum();
    if p.group_slot_mapping.len() != g * p.positions.len()
        || p.group_block_tables.len() != g * p.num_reqs() * p.max_blocks
        || p.group_num_copies.iter().any(|&c| c < 0)
        || pairs * 2 != p.group_copies.len() as i64
        || p.group_num_blocks.len() != g
        || [&p.group_swap_out, &p.group_swap_in, &p.group_block_moves]
            .iter()
            .any(|t| t.len() % 3 != 0 || t.chunks(3).any(|c| c[0] < 0 || c[0] as usize >= g))
    {
        return Err(Error::InvalidRequest(format!(
            "step wire: group arrays ({} slots, {} table entries, {} copy ids, {} + {} swap ids) \
             {} move ids, {} pool sizes) do not fit {g} groups of {} tokens, {} rows x {} blocks, \
             {pairs} copy pairs, swap and move triples (group, block, block)",
            p.group_slot_mapping.len(),
            p.group_block_tables.len(),
            p.group_copies.len(),
            p.group_swap_out.len(),
            p.group_swap_in.len(),
            p.group_block_moves.len(),
            p.group_num_blocks.len(),
            p.positions.len(),
            p.num_reqs(),
            p.max_blocks
        )));
    }
    Ok(())
}

impl StepPlan {
    /// `(header, payload)` of this plan with its dense block tables (`[B, max_blocks]`) and the
    /// extra logits rows.
    pub fn to_wire(
        &self,
        block_tables: &[i32],
        extra_logits_indices: &[i64],
    ) -> (Vec<i64>, Vec<i64>) {
        let mut header = vec![0i64; WIRE_HEADER_LEN];
        header[0] = OP_EXECUTE;
        let scalars = [
            self.step_id as i64,
            self.num_blocks as i64,
            self.num_prefill_tokens as i64,
            self.num_decode_tokens as i64,
            self.num_tokens as i64,
            self.max_blocks as i64,
        ];
        header[2..2 + NUM_SCALARS].copy_from_slice(&scalars);
        let mut payload: Vec<i64> = Vec::new();
        let mut lens = Vec::with_capacity(NUM_ARRAYS);
        let mut push = |it: &mut dyn Iterator<Item = i64>| {
            let before = payload.len();
            payload.extend(it);
            lens.push((payload.len() - before) as i64);
        };
        push(&mut self.req_ids.iter().copied());
        push(&mut i32s(&self.num_scheduled_tokens));
        push(&mut i32s(&self.num_computed_tokens));
        push(&mut i32s(&self.num_prompt_tokens));
        push(&mut i32s(&self.seq_lens));
        push(&mut i32s(&self.query_start_loc));
        push(&mut self.input_ids.iter().copied());
        push(&mut self.positions.iter().copied());
        push(&mut self.slot_mapping.iter().copied());
        push(&mut i32s(&self.block_table_rows));
        push(&mut i32s(&self.changed_rows));
        push(&mut self.logits_indices.iter().copied());
        push(&mut self.sampled_seq_ids.iter().copied());
        push(&mut self.swap_out.iter().copied());
        push(&mut self.swap_in.iter().copied());
        push(&mut self.copies.iter().copied());
        push(&mut self.block_moves.iter().copied());
        push(&mut self.preempted.iter().copied());
        push(&mut i32s(&self.num_draft_tokens));
        push(&mut self.draft_token_ids.iter().copied());
        push(&mut self.group_slot_mapping.iter().copied());
        push(&mut i32s(&self.group_block_tables));
        push(&mut self.group_copies.iter().copied());
        push(&mut i32s(&self.group_num_copies));
        push(&mut self.group_swap_out.iter().copied());
        push(&mut self.group_swap_in.iter().copied());
        push(&mut self.tier_store.iter().copied());
        push(&mut self.tier_load.iter().copied());
        push(&mut self.group_block_moves.iter().copied());
        push(&mut self.group_num_blocks.iter().copied());
        push(&mut i32s(block_tables));
        push(&mut extra_logits_indices.iter().copied());
        debug_assert_eq!(lens.len(), NUM_ARRAYS);
        header[2 + NUM_SCALARS..].copy_from_slice(&lens);
        header[1] = payload.len() as i64;
        (header, payload)
    }

    /// The plan a driver sent with [`StepPlan::to_wire`]; an error names what does not add up.
    pub fn from_wire(header: &[i64], payload: &[i64]) -> Result<WirePlan> {
        if header.len() != WIRE_HEADER_LEN || header[0] != OP_EXECUTE {
            return Err(Error::InvalidRequest(format!(
                "step wire: header of {} values with op {:?} is not a step plan",
                header.len(),
                header.first()
            )));
        }
        let lens = &header[2 + NUM_SCALARS..];
        let total: i64 = lens.iter().sum();
        if lens.iter().any(|&n| n < 0) || total != header[1] || total as usize != payload.len() {
            return Err(Error::InvalidRequest(format!(
                "step wire: array lengths {lens:?} do not add up to the payload of {}",
                payload.len()
            )));
        }
        let mut parts: Vec<&[i64]> = Vec::with_capacity(NUM_ARRAYS);
        let mut at = 0usize;
        for &n in lens {
            parts.push(&payload[at..at + n as usize]);
            at += n as usize;
        }
        let s = &header[2..2 + NUM_SCALARS];
        let plan = StepPlan {
            step_id: s[0] as u64,
            req_ids: parts[0].to_vec(),
            num_scheduled_tokens: narrow("num_scheduled_tokens", parts[1])?,
            num_computed_tokens: narrow("num_computed_tokens", parts[2])?,
            num_prompt_tokens: narrow("num_prompt_tokens", parts[3])?,
            seq_lens: narrow("seq_lens", parts[4])?,
            query_start_loc: narrow("query_start_loc", parts[5])?,
            input_ids: parts[6].to_vec(),
            positions: parts[7].to_vec(),
            slot_mapping: parts[8].to_vec(),
            block_table_rows: narrow("block_table_rows", parts[9])?,
            changed_rows: narrow("changed_rows", parts[10])?,
            max_blocks: count("max_blocks", s[5])?,
            logits_indices: parts[11].to_vec(),
            sampled_seq_ids: parts[12].to_vec(),
            swap_out: parts[13].to_vec(),
            swap_in: parts[14].to_vec(),
            copies: parts[15].to_vec(),
            block_moves: parts[16].to_vec(),
            preempted: parts[17].to_vec(),
            num_draft_tokens: narrow("num_draft_tokens", parts[18])?,
            draft_token_ids: parts[19].to_vec(),
            group_slot_mapping: parts[20].to_vec(),
            group_block_tables: narrow("group_block_tables", parts[21])?,
            group_copies: parts[22].to_vec(),
            group_num_copies: narrow("group_num_copies", parts[23])?,
            group_swap_out: parts[24].to_vec(),
            group_swap_in: parts[25].to_vec(),
            tier_store: parts[26].to_vec(),
            tier_load: parts[27].to_vec(),
            group_block_moves: parts[28].to_vec(),
            group_num_blocks: parts[29].to_vec(),
            num_blocks: count("num_blocks", s[1])?,
            num_prefill_tokens: count("num_prefill_tokens", s[2])?,
            num_decode_tokens: count("num_decode_tokens", s[3])?,
            num_tokens: count("num_tokens", s[4])?,
        };
        check_groups(&plan)?;
        let block_tables = narrow("block_tables", parts[30])?;
        if block_tables.len() != plan.num_reqs() * plan.max_blocks {
            return Err(Error::InvalidRequest(format!(
                "step wire: {} block-table entries for {} requests x {} blocks",
                block_tables.len(),
                plan.num_reqs(),
                plan.max_blocks
            )));
        }
        Ok(WirePlan {
            plan,
            block_tables,
            extra_logits_indices: parts[31].to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> StepPlan {
        StepPlan {
            step_id: 7,
            req_ids: vec![3, 9],
            num_scheduled_tokens: vec![2, 1],
            num_computed_tokens: vec![0, 5],
            num_prompt_tokens: vec![2, 4],
            seq_lens: vec![2, 6],
            query_start_loc: vec![0, 2, 3],
            input_ids: vec![11, 12, 13],
            positions: vec![0, 1, 5],
            slot_mapping: vec![16, 17, 37],
            block_table_rows: vec![4, 1],
            changed_rows: vec![4],
            max_blocks: 2,
            logits_indices: vec![1, 2],
            sampled_seq_ids: vec![3, 9],
            num_draft_tokens: vec![0, 1],
            draft_token_ids: vec![13],
            swap_out: vec![1, 0],
            swap_in: vec![],
            copies: vec![2, 5],
            block_moves: vec![],
            preempted: vec![8],
            group_slot_mapping: vec![4, 5, 9],
            group_block_tables: vec![1, 0, 2, 3],
            group_copies: vec![6, 7],
            group_num_copies: vec![1],
            group_swap_out: vec![0, 3, 1],
            group_swap_in: vec![0, 2, 8, 0, 4, 9],
            tier_store: vec![3, 0],
            tier_load: vec![1, 6, 2, 7],
            group_block_moves: vec![0, 9, 1],
            group_num_blocks: vec![12],
            num_blocks: 40,
            num_prefill_tokens: 2,
            num_decode_tokens: 1,
            num_tokens: 3,
        }
    }

    #[test]
    fn round_trip_keeps_every_field() {
        let plan = sample();
        let (header, payload) = plan.to_wire(&[1, 0, 2, 3], &[0, 1]);
        assert_eq!(header.len(), WIRE_HEADER_LEN);
        let got = StepPlan::from_wire(&header, &payload).unwrap();
        assert_eq!(got.plan, plan);
        assert_eq!(got.block_tables, vec![1, 0, 2, 3]);
        assert_eq!(got.extra_logits_indices, vec![0, 1]);
    }

    #[test]
    fn bad_messages_are_errors() {
        let plan = sample();
        let (mut header, payload) = plan.to_wire(&[1, 0, 2, 3], &[]);
        assert!(StepPlan::from_wire(&header, &payload[1..]).is_err());
        assert!(StepPlan::from_wire(&header[1..], &payload).is_err());
        let (h2, p2) = plan.to_wire(&[1, 0, 2], &[]); // 3 entries for 2 x 2
        assert!(StepPlan::from_wire(&h2, &p2).is_err());
        header[0] = 2;
        assert!(StepPlan::from_wire(&header, &payload).is_err());
        // A group table short of one entry, and a copy count that does not match the pairs.
        let mut short = plan.clone();
        short.group_block_tables.pop();
        let (h3, p3) = short.to_wire(&[1, 0, 2, 3], &[]);
        assert!(StepPlan::from_wire(&h3, &p3).is_err());
        let mut odd = plan.clone();
        odd.group_num_copies = vec![2];
        let (h4, p4) = odd.to_wire(&[1, 0, 2, 3], &[]);
        assert!(StepPlan::from_wire(&h4, &p4).is_err());
        // A swap triple short of one id, and one naming a group the plan does not have.
        let mut cut = plan.clone();
        cut.group_swap_in.pop();
        let (h5, p5) = cut.to_wire(&[1, 0, 2, 3], &[]);
        assert!(StepPlan::from_wire(&h5, &p5).is_err());
        let mut stray = plan.clone();
        stray.group_swap_out[0] = 1;
        let (h6, p6) = stray.to_wire(&[1, 0, 2, 3], &[]);
        assert!(StepPlan::from_wire(&h6, &p6).is_err());
        // A move naming a group the plan does not have, and a pool size per group missing.
        let mut moved = plan.clone();
        moved.group_block_moves[0] = 1;
        let (h7, p7) = moved.to_wire(&[1, 0, 2, 3], &[]);
        assert!(StepPlan::from_wire(&h7, &p7).is_err());
        let mut sizes = plan.clone();
        sizes.group_num_blocks.clear();
        let (h8, p8) = sizes.to_wire(&[1, 0, 2, 3], &[]);
        assert!(StepPlan::from_wire(&h8, &p8).is_err());
    }
}
