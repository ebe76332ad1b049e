// Causal multi-head self-attention on a fused query/key/value projection, with its
// own backward.
//
//   qkv [B, T, 3W]: per token the queries, then the keys, then the values, each W
//                   wide with the heads side by side (head h at columns h*d..(h+1)*d,
//                   d = W / heads); what Linear(width, 3 width) gives.
//   out [B, T, W]:  softmax(q k^T / sqrt(d), causal) v per head, heads side by side
//                   (ready for the output projection).
//
// On CPU float32 each (example, head) is two oneDNN matrix products forward and
// four backward, reading q, k and v where they lie in `qkv` and writing the output and
// the gradient in place, with ATen's softmax and its backward on the whole batch in
// one call each. Against the same maths written with ATen ops (split, transpose,
// matmul, masked_fill, softmax, a contiguous copy back), this drops per-head
// dispatch, the copies and the mask; the GPT of configs/kjv_gpt.textproto spends
// about a quarter of its step in attention (benchmarks/gpt.sh). Other devices and
// dtypes, and builds without oneDNN, run the ATen composite (same results to
// rounding). It keeps the softmax output for the backward, as autograd would.
//
// Throws InvalidArgumentError for a qkv that is not [B, T, 3W] with W divisible by
// num_heads.
#ifndef LOCKSTEP_ATTENTION_H_
#define LOCKSTEP_ATTENTION_H_

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace lockstep {

// The fused path where it applies (CPU float32 with oneDNN), else the composite.
at::Tensor CausalSelfAttention(const at::Tensor& qkv, int64_t num_heads);

// The same maths as ATen ops, differentiated by autograd: the reference the fused
// path is tested against, and the path for other devices. `dropout` applies to the
// attention weights when `train`.
at::Tensor CausalSelfAttentionComposite(const at::Tensor& qkv, int64_t num_heads, double dropout = 0,
                                        bool train = false);

// Whether CausalSelfAttention takes the fused path for `qkv`.
bool FusedCausalSelfAttentionApplies(const at::Tensor& qkv);

}  // namespace lockstep

#endif  // LOCKSTEP_ATTENTION_H_
