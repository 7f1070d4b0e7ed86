// smoe/reference.h -- float64 CPU reference of the whole MoE layer.
//
// Plain C++17, no CUDA. Every GPU kernel of the library is judged against these functions.
// They are written for clarity, not speed: use small shapes.
//
// Notation: T tokens, d hidden size, n expert intermediate size, E experts, K experts per token.
// "Entries" are (token, expert, score) triples of a routing, stored token-major (CSR by token):
// for top-K routing entry j = t*K + k. "Grouped rows" are the same entries sorted by expert, then
// by entry index (a stable sort), which is the row order of every grouped GEMM.
//
// Layouts (identical to the GPU library, see smoe/smoe.h):
//   x         [T][d]            row-major
//   w_router  [E][d]            logits = x w_router^T   (nn.Linear weight layout)
//   w1        [E][2n][d]        gate/up INTERLEAVED by row: row 2j is gate column j, row 2j+1 is
//                               up column j (torchtitan: w1[e][2j] = tt.w1[e][j],
//                               w1[e][2j+1] = tt.w3[e][j]); H = x w1_e^T
//   w2        [E][d][n]         Y = A w2_e^T (torchtitan w2 layout)
//   h         [rows][2n]        pre-activation, interleaved like w1, in grouped-row order
//   a         [rows][n]         a = silu(gate) * up
#pragma once

#include <cstdint>
#include <vector>

namespace smoe {
namespace ref {

// ---------------------------------------------------------------------------------------------
// Routing
// ---------------------------------------------------------------------------------------------

// Top-K routing: expert[t*K+k], score[t*K+k]. The K experts of a token are ordered by descending
// logit; equal logits go to the lower expert index. Scores are the softmax over the K chosen
// logits (equal to softmax over E renormalised over the top K).
struct TopKRouting {
  int64_t T = 0;
  int E = 0;
  int K = 0;
  std::vector<int32_t> expert;  // [T*K]
  std::vector<double> score;    // [T*K]
};

TopKRouting topk_softmax_ref(const std::vector<double>& logits, int64_t T, int E, int K);

// General routing: a variable number of experts per token (token rounding produces it).
// Entries of token t are [token_offset[t], token_offset[t+1]); a token never lists an expert twice.
struct GeneralRouting {
  int64_t T = 0;
  int E = 0;
  std::vector<int64_t> token_offset;  // [T+1]
  std::vector<int32_t> expert;        // [nnz]
  std::vector<double> score;          // [nnz]
  int64_t nnz() const { return token_offset.empty() ? 0 : token_offset.back(); }
};

GeneralRouting to_general(const TopKRouting& r);

// Routing metadata over the entries of a routing.
struct RoutingMetadata {
  std::vector<int32_t> expert_frequency;     // [E]   entries routed to each expert
  std::vector<int64_t> expert_offset;        // [E+1] exclusive prefix sum of expert_frequency
  std::vector<int32_t> scatter_idx;          // [nnz] grouped row -> entry index (t*K+k for top-K)
  std::vector<int32_t> reverse_scatter_idx;  // [nnz] entry index -> grouped row
  std::vector<int32_t> gather_idx;           // [nnz] grouped row -> token
};

RoutingMetadata routing_metadata_ref(const GeneralRouting& r);

// Router backward of top-K softmax: given dS[t*K+k] = dL/dscore, returns dlogits [T][E].
// For the K chosen: dlogit_k = s_k (dS_k - sum_j dS_j s_j); zero for the others.
std::vector<double> router_backward_ref(const TopKRouting& r, const std::vector<double>& dS);

// ---------------------------------------------------------------------------------------------
// Token rounding (SonicMoE "TR"): round each expert's count to a multiple of m_tile.
// ---------------------------------------------------------------------------------------------
enum class RoundingMode {
  kNearest,     // NR-f: nearest multiple of m_tile, ties (exactly half a tile) round down
  kUp,          // always up (ceil)
  kDown,        // always down (floor)
  kStochastic,  // SR-f: up with probability (f mod m_tile) / m_tile, from a seeded counter hash
};

// The rounded count of one expert. Result is clamped to [0, T] (rounding up past T is impossible:
// an expert can take each token at most once). Stochastic mode draws u = uniform01(seed, expert)
// (see below) and rounds up iff u < (f mod m_tile) / m_tile.
int64_t rounded_count(int64_t f, int64_t T, int m_tile, RoundingMode mode, uint64_t seed,
                      int expert);

// The counter-based uniform draw used by kStochastic: splitmix64(seed ^ splitmix64(expert)) with
// the top 53 bits mapped to [0, 1). Deterministic and reproducible on the GPU.
double uniform01(uint64_t seed, int expert);

// Token rounding: S = softmax(logits) over E; top-K as in topk_softmax_ref (chosen scores are the
// softmax over the K chosen logits); S' = S - 1 everywhere, then S'[t, chosen] = chosen score, so
// that every chosen token outranks every non-chosen one. Per expert e: f_e = number of tokens that
// chose e; sort tokens by S'[:, e] descending (equal values: lower token first) and keep the first
// rounded_count(f_e) tokens, padding with the best non-chosen tokens or dropping the worst chosen.
// The score of a kept entry is the chosen score for a chosen token, S[t][e] for a padded token.
// Output entries are token-major, ascending expert index within a token.
GeneralRouting token_rounding_ref(const std::vector<double>& logits, int64_t T, int E, int K,
                                  int m_tile, RoundingMode mode, uint64_t seed);

// Router backward of token-rounded routing: tr = token_rounding_ref(logits, ...), topk = the top-K
// routing it started from, dS[j] = dL/dscore of entry j of tr. A kept chosen entry's score is the
// softmax over the token's K chosen logits (a chosen entry that rounding dropped still shares that
// softmax, with dS = 0); a padded entry's score is S_e = softmax over all E, so it adds
// dS_p S_e (delta_ej - S_j) to dlogit_j for every j. Returns dlogits [T][E].
std::vector<double> token_rounding_router_backward_ref(const std::vector<double>& logits,
                                                       const TopKRouting& topk,
                                                       const GeneralRouting& tr,
                                                       const std::vector<double>& dS);

// ---------------------------------------------------------------------------------------------
// MoE layer with SwiGLU experts
// ---------------------------------------------------------------------------------------------
struct MoEShape {
  int64_t T = 0;
  int d = 0;
  int n = 0;
  int E = 0;
  int K = 0;  // top-K routing only; general routing ignores it
};

struct MoEWeights {
  std::vector<double> w_router;  // [E][d]
  std::vector<double> w1;        // [E][2n][d], gate/up interleaved by row
  std::vector<double> w2;        // [E][d][n]
};

// SwiGLU on one (gate, up) pair and its derivative (d/dgate, d/dup of silu(g)*u times da).
double swiglu_ref(double g, double u);
void dswiglu_ref(double g, double u, double da, double* dg, double* du);

// Expert part of the forward for a given routing (the router is outside).
struct ExpertForward {
  std::vector<double> h;  // [nnz][2n] grouped-row order
  std::vector<double> a;  // [nnz][n]  grouped-row order
  std::vector<double> y;  // [nnz][d]  grouped-row order (only the plain chain rule needs it)
  std::vector<double> o;  // [T][d]    o[t] = sum over entries of t: score * y[row]
};

ExpertForward experts_forward_ref(const std::vector<double>& x, const MoEShape& s,
                                  const MoEWeights& w, const GeneralRouting& r,
                                  const RoutingMetadata& m);

struct ExpertGrads {
  std::vector<double> dx;   // [T][d]  through the experts only
  std::vector<double> dw1;  // [E][2n][d]
  std::vector<double> dw2;  // [E][d][n]
  std::vector<double> ds;   // [nnz] entry order: dL/dscore
};

// Plain chain rule through Y: dY_row = s * dO[t], dS = <dO[t], Y_row>, dA = dY W2, ...
ExpertGrads experts_backward_chain_ref(const std::vector<double>& x, const std::vector<double>& dO,
                                       const MoEShape& s, const MoEWeights& w,
                                       const GeneralRouting& r, const RoutingMetadata& m,
                                       const ExpertForward& f);

// SonicMoE's rewrite, using only H (never Y): dA' = dO[t] W2 (gathered dO), A = SwiGLU(H),
// dH = dSwiGLU(H) applied to s*dA', A' = s*A, dS = <dA', A>, dW2 = A'^T dO, dW1 = dH^T X,
// dX[t] = sum over the entries of t of dH_row W1.
ExpertGrads experts_backward_sonic_ref(const std::vector<double>& x, const std::vector<double>& dO,
                                       const MoEShape& s, const MoEWeights& w,
                                       const GeneralRouting& r, const RoutingMetadata& m,
                                       const std::vector<double>& h);

// The whole layer with the router: logits = x w_router^T, top-K softmax, metadata, experts.
struct LayerForward {
  std::vector<double> logits;  // [T][E]
  TopKRouting routing;
  bool token_rounding = false;  // general = token_rounding_ref(logits, ...) instead of top-K
  GeneralRouting general;
  RoutingMetadata meta;
  ExpertForward experts;
};

struct LayerGrads {
  std::vector<double> dx;        // [T][d] experts + router contribution
  std::vector<double> dw_router;  // [E][d]
  std::vector<double> dw1;       // [E][2n][d]
  std::vector<double> dw2;       // [E][d][n]
  std::vector<double> ds;        // [T*K] (by entry of the general routing with token rounding)
  std::vector<double> dlogits;   // [T][E]
};

enum class BackwardMethod { kChainRule, kSonic };

LayerForward layer_forward_ref(const std::vector<double>& x, const MoEShape& s,
                               const MoEWeights& w);
// The layer with token rounding after the top-K (SonicMoE TR): the same as layer_forward_ref with
// general = token_rounding_ref(logits, T, E, K, m_tile, mode, seed); layer_backward_ref then takes
// the router gradient through token_rounding_router_backward_ref (grads.ds is by entry of general).
LayerForward layer_forward_tr_ref(const std::vector<double>& x, const MoEShape& s, const MoEWeights& w,
                                  int m_tile, RoundingMode mode, uint64_t seed);
LayerGrads layer_backward_ref(const std::vector<double>& x, const std::vector<double>& dO,
                              const MoEShape& s, const MoEWeights& w, const LayerForward& f,
                              BackwardMethod method);

// Layout conversion at the boundary: torchtitan's separate gate (w1) and up (w3), each
// [E][n][d], into the interleaved [E][2n][d] layout, and back.
std::vector<double> interleave_gate_up(const std::vector<double>& gate,
                                       const std::vector<double>& up, int E, int n, int d);
void deinterleave_gate_up(const std::vector<double>& w1, int E, int n, int d,
                          std::vector<double>* gate, std::vector<double>* up);

// ---------------------------------------------------------------------------------------------
// The expert-major layer (smoe/expert_major.h): rows already grouped by expert, per-expert counts,
// optional per-row probabilities, padding rows.
// ---------------------------------------------------------------------------------------------
// Rows of each expert: begin[e] = segment_offset[e] when segment_offset is given ([E+1]), else the
// prefix sum of counts; expert e owns [begin[e], begin[e] + counts[e]). Returns false (and leaves
// the outputs empty) when the counts break the rules the GPU checks: a negative count, a count past
// its segment, a decreasing segment_offset, or rows past R.
bool expert_major_rows_ref(const std::vector<int32_t>& counts, const std::vector<int32_t>& segment_offset,
                           int64_t R, std::vector<int64_t>* begin, std::vector<int32_t>* row_expert);

// row_expert[r] = the expert of row r, -1 for a padding row (from expert_major_rows_ref).
struct ExpertMajorForward {
  std::vector<double> h;    // [R][2n] interleaved like w1 (padding rows 0)
  std::vector<double> a;    // [R][n]  SwiGLU(h)
  std::vector<double> y;    // [R][d]  a W2_e^T (unscaled)
  std::vector<double> out;  // [R][d]  p[r] * y[r] (p = 1 without probs); padding rows 0
};
// w: interleaved w1 (interleave_gate_up / concatenated_to_interleaved convert the other layouts);
// s.T and s.K are ignored. probs empty: p = 1.
ExpertMajorForward expert_major_forward_ref(const std::vector<double>& x, int64_t R, const MoEShape& s,
                                            const MoEWeights& w, const std::vector<int32_t>& row_expert,
                                            const std::vector<double>& probs);
struct ExpertMajorGrads {
  std::vector<double> dx;      // [R][d] (padding rows 0)
  std::vector<double> dw1;     // [E][2n][d] interleaved
  std::vector<double> dw2;     // [E][d][n]
  std::vector<double> dprobs;  // [R] <dout[r], y[r]> (padding rows 0); empty without probs
};
// SonicMoE's rewrite as the GPU runs it: dA' = dout W2_e, A = SwiGLU(H), dH = dSwiGLU(H) of p dA',
// A' = p A, dprobs = <dA', A>, dW2 = dout^T A', dW1 = dH^T x, dx = dH W1_e.
ExpertMajorGrads expert_major_backward_ref(const std::vector<double>& x, const std::vector<double>& dout,
                                           int64_t R, const MoEShape& s, const MoEWeights& w,
                                           const std::vector<int32_t>& row_expert,
                                           const std::vector<double>& probs, const ExpertMajorForward& f);

// Megatron-Core / transformers' concatenated fc1 [E][2n][d] (rows [0, n) gate, [n, 2n) up) to the
// interleaved layout, and back.
std::vector<double> concatenated_to_interleaved(const std::vector<double>& w1_cat, int E, int n, int d);
std::vector<double> interleaved_to_concatenated(const std::vector<double>& w1, int E, int n, int d);

// ---------------------------------------------------------------------------------------------
// Expert parallelism (EP): the deterministic layout, as the spec of the multi-GPU kernels
// ---------------------------------------------------------------------------------------------
// R ranks; expert e lives on rank e / (E/R) as its local expert e % (E/R) (E % R == 0). Rank s holds
// its own tokens and their routing (token-major entries). Dispatch sends every token ONCE to each
// rank that owns at least one of its experts. The layout depends only on the routings, so every
// placement below is a prefix sum: no slot-grabbing atomics, the same receive order on every run.
//   receive buffer of rank r: the tokens of source rank 0 (ascending token), then of rank 1, ...;
//     slot = recv_offset[r][s] + (position of t among the tokens s sends to r)
//   grouped rows of rank r: by local expert, then receive slot (so by source rank, then token);
//     row -> receive slot (the gather of the up-projection), -> (source rank, source entry)
//   combine: each rank reduces its rows of one received token in that token's entry order, and
//     returns one row per (token, rank) to the token's slot of the source; the source adds the
//     per-rank partial rows in ascending rank order.
struct EpRankLayout {
  std::vector<int64_t> recv_offset;     // [R]    first slot of each source rank's tokens
  std::vector<int32_t> recv_src_rank;   // [slots] source rank of each receive slot
  std::vector<int64_t> recv_src_token;  // [slots] source token of each receive slot
  std::vector<int64_t> expert_offset;   // [E/R + 1] grouped rows per local expert
  std::vector<int64_t> row_slot;        // [rows] receive slot of each grouped row
  std::vector<int32_t> row_src_rank;    // [rows]
  std::vector<int64_t> row_src_entry;   // [rows] entry index in the source rank's routing
};
struct EpLayout {
  int R = 0, E = 0;
  std::vector<std::vector<int64_t>> send_tokens;  // [s*R + r] tokens s sends to r, ascending
  std::vector<EpRankLayout> rank;                 // [R] what each rank receives and computes
};
EpLayout ep_layout_ref(const std::vector<GeneralRouting>& routing_per_rank, int R);

// The experts' forward under EP through that layout (float64): out per source rank [T_s][d], with
// the combine order above. It must equal experts_forward_ref of all ranks' tokens on one GPU (up to
// float64 rounding: only the summation order of a token's experts differs).
std::vector<std::vector<double>> ep_experts_forward_ref(const std::vector<std::vector<double>>& x_per_rank,
                                                        const MoEShape& s, const MoEWeights& w,
                                                        const std::vector<GeneralRouting>& routing_per_rank,
                                                        const EpLayout& layout);

// Relative L2 error ||a - b|| / ||b|| (returns ||a|| when b is all zero; NaN propagates).
double rel_l2(const std::vector<double>& a, const std::vector<double>& b);

}  // namespace ref
}  // namespace smoe
