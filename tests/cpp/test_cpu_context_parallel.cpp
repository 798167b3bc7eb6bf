// Context parallelism from C++, composed of the core's own calls (README, "Context
// parallelism"): one packed batch over R ranks, each holding an equal contiguous slice of the
// tokens, here all in one process on the CPU backend in fp64, against the single call.
//
// Per rank, for its last local sequence when that goes on to a later rank: the forward from zero
// gives S0 (the slice's end state without the entering one) and the forward from the identity
// with v = 0 gives the transfer map M (S_end = M S_in + S0; K = V here, so the identity is a
// state); when the sequence also started on this rank, its end state from h0 is sent with
// M = 0. The caller exchanges those blocks (an all_gather across ranks); a rank whose first
// local sequence started earlier folds S <- M_m S + S0_m over the ranks from the one where it
// started, and runs its forward with that initial state.
// The backward mirrors it for the gradient at each slice's end state (run_cp, second half).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "problem.h"

using namespace qla_test;

namespace {

struct Out {
  std::vector<double> o, ht;  // [T, HV, V], [N, HV, K, V]
};

Out forward(const Problem& p) {
  Buffers buf;
  qla::GdnForwardParams f = forward_params(p, qla::DType::kFloat64, buf, true);
  f.num_threads = 2;
  const qla::Status s = qla::gdn_forward(f);
  EXPECT_TRUE(s.ok()) << s.message();
  Out r;
  r.o.resize(p.T * p.HV * p.V);
  r.ht.resize(p.N() * p.HV * p.K * p.V);
  for (size_t i = 0; i < r.o.size(); ++i) r.o[i] = decode(buf.o, qla::DType::kFloat64, i);
  for (size_t i = 0; i < r.ht.size(); ++i) r.ht[i] = decode(buf.ht, qla::DType::kFloat64, i);
  return r;
}

// Rows lo .. hi - 1 of x, `per` values each (tokens, or state blocks).
std::vector<double> rows(const std::vector<double>& x, int64_t lo, int64_t hi, int64_t per) {
  return std::vector<double>(x.begin() + lo * per, x.begin() + hi * per);
}

// Tokens [lo, hi) of a packed problem (B = 1), the sequences cut at the slice's ends: its local
// sequences are the global ones that overlap it (and empty ones starting inside it), each with
// its global h0 row. seq[i]: the global index of local sequence i.
Problem slice(const Problem& p, int64_t lo, int64_t hi, std::vector<int64_t>& seq) {
  Problem s = p;
  s.T = hi - lo;
  s.cu = {0};
  seq.clear();
  for (int64_t n = 0; n + 1 < static_cast<int64_t>(p.cu.size()); ++n) {
    const int64_t a = p.cu[n], b = p.cu[n + 1];
    if (b > lo && a < hi) {
      seq.push_back(n);
      s.cu.push_back(std::min(b, hi) - lo);
    } else if (a == b && a >= lo && a < hi) {  // empty, inside the slice
      seq.push_back(n);
      s.cu.push_back(a - lo);
    }
  }
  s.q = rows(p.q, lo, hi, p.H * p.K);
  s.k = rows(p.k, lo, hi, p.H * p.K);
  s.v = rows(p.v, lo, hi, p.HV * p.V);
  s.g = rows(p.g, lo, hi, p.HV);
  s.beta = rows(p.beta, lo, hi, p.HV);
  const int64_t st = p.HV * p.K * p.V;
  s.h0.assign(seq.size() * st, 0.0);
  for (size_t i = 0; i < seq.size(); ++i)
    std::memcpy(&s.h0[i * st], &p.h0[seq[i] * st], st * sizeof(double));
  return s;
}

// Local sequence i alone (its tokens, h0 row `h0`), optionally with v = 0.
Problem one_sequence(const Problem& s, int64_t i, const std::vector<double>& h0, bool zero_v) {
  const int64_t a = s.cu[i], b = s.cu[i + 1];
  Problem r = s;
  r.T = b - a;
  r.cu = {0, b - a};
  r.q = rows(s.q, a, b, s.H * s.K);
  r.k = rows(s.k, a, b, s.H * s.K);
  r.v = rows(s.v, a, b, s.HV * s.V);
  if (zero_v) std::fill(r.v.begin(), r.v.end(), 0.0);
  r.g = rows(s.g, a, b, s.HV);
  r.beta = rows(s.beta, a, b, s.HV);
  r.h0 = h0;
  return r;
}

// Per head: S <- M S + S0 (K x K times K x V, K = V), or with M^T (the backward's fold of the
// gradient, dS <- M^T dS + dS0).
void fold(std::vector<double>& S, const std::vector<double>& M, const std::vector<double>& S0, int64_t HV, int64_t K,
          bool transpose = false) {
  std::vector<double> out(S0);
  for (int64_t h = 0; h < HV; ++h)
    for (int64_t i = 0; i < K; ++i)
      for (int64_t m = 0; m < K; ++m) {
        const double a = transpose ? M[(h * K + m) * K + i] : M[(h * K + i) * K + m];
        for (int64_t j = 0; j < K; ++j) out[(h * K + i) * K + j] += a * S[(h * K + m) * K + j];
      }
  S = out;
}

void run_cp(const std::vector<int64_t>& lens, int64_t R, uint32_t seed) {
  std::vector<int64_t> cu = {0};
  for (int64_t l : lens) cu.push_back(cu.back() + l);
  const int64_t T = cu.back(), L = T / R, H = 1, HV = 2, K = 8;
  ASSERT_EQ(T % R, 0);
  Problem p = make_problem(seed, 1, T, H, HV, K, K, cu);
  for (int64_t t = 0; t < T; ++t) p.g[t * HV] = 0.0;  // one head that never decays
  const Out ref = forward(p);
  const int64_t st = HV * K * K;

  // Step 1 on every rank: what its last local sequence sends on, if it goes on.
  struct Send {
    bool on = false;
    std::vector<double> S0, M;  // M empty: the sequence started here (M = 0)
  };
  std::vector<Send> sent(R);
  std::vector<std::vector<int64_t>> seqs(R);
  std::vector<Problem> local(R);
  std::vector<double> identity(st, 0.0);
  for (int64_t h = 0; h < HV; ++h)
    for (int64_t i = 0; i < K; ++i) identity[(h * K + i) * K + i] = 1.0;
  for (int64_t j = 0; j < R; ++j) {
    local[j] = slice(p, j * L, (j + 1) * L, seqs[j]);
    const std::vector<int64_t>& sq = seqs[j];
    ASSERT_FALSE(sq.empty());
    const int64_t last = static_cast<int64_t>(sq.size()) - 1, n = sq[last];
    if (cu[n + 1] <= (j + 1) * L) continue;  // ends on this rank
    sent[j].on = true;
    const std::vector<double> h0 = rows(local[j].h0, last, last + 1, st);
    if (cu[n] >= j * L) {  // started here: its end state from h0, M = 0
      sent[j].S0 = forward(one_sequence(local[j], last, h0, false)).ht;
    } else {
      sent[j].S0 = forward(one_sequence(local[j], last, std::vector<double>(st, 0.0), false)).ht;
      sent[j].M = forward(one_sequence(local[j], last, identity, true)).ht;
    }
  }

  // Steps 3 and 4 on every rank, after the exchange (`sent` is what every rank gathered).
  for (int64_t j = 0; j < R; ++j) {
    const std::vector<int64_t>& sq = seqs[j];
    const int64_t first = sq[0];
    Problem& lp = local[j];
    if (cu[first] < j * L) {  // continues: fold from the rank where it started
      std::vector<double> S(st, 0.0);
      for (int64_t m = cu[first] / L; m < j; ++m) {
        ASSERT_TRUE(sent[m].on) << "rank " << m;
        if (sent[m].M.empty()) S = sent[m].S0;
        else fold(S, sent[m].M, sent[m].S0, HV, K);
      }
      std::copy(S.begin(), S.end(), lp.h0.begin());
    }
    const Out out = forward(lp);
    // o on the slice: the single call's rows.
    const std::vector<double> o_ref = rows(ref.o, j * L, (j + 1) * L, HV * K);
    EXPECT_LT(rel_l2(out.o, o_ref), 1e-10) << "rank " << j << " of " << R << ": o";
    for (size_t i = 0; i < sq.size(); ++i) {
      const int64_t n = sq[i];
      const std::vector<double> h = rows(out.ht, i, i + 1, st);
      if (cu[n + 1] <= (j + 1) * L) {  // ends here: the single call's final state
        const std::vector<double> hr = rows(ref.ht, n, n + 1, st);
        EXPECT_LT(rel_l2(h, hr), 1e-10) << "rank " << j << " of " << R << ": final state of sequence " << n;
      } else {  // goes on: its state after this slice, as its prefix run alone gives it
        std::vector<int64_t> pseq;
        const Problem prefix = slice(p, cu[n], (j + 1) * L, pseq);
        const int64_t at = std::find(pseq.begin(), pseq.end(), n) - pseq.begin();  // after empty ones at cu[n]
        const std::vector<double> h0 = rows(p.h0, n, n + 1, st);
        const std::vector<double> hr = forward(one_sequence(prefix, at, h0, false)).ht;
        EXPECT_LT(rel_l2(h, hr), 1e-10) << "rank " << j << " of " << R << ": state of sequence " << n << " at the slice end";
      }
    }
  }

  // The backward of L = <o, W> + <ht, Wh> (final states of the global sequences). Pass A on
  // every rank: the local backward with d(final state) 0 for a last sequence that goes on; its
  // first sequence's d(initial state) is then that rank's part of the gradient at the entering
  // state, dS_j, sent on with M_j. After the exchange, the fold dS <- M_m^T dS + dS_m from the
  // rank where the last sequence ends back to this one gives its d(final state), and pass B is
  // the local backward with it.
  const std::vector<double> W = randn(seed + 100, T * HV * K), Wh = randn(seed + 101, p.N() * st);
  const Grads gref = backward(p, W, Wh, qla::DType::kFloat64);
  auto local_dht = [&](int64_t j) {
    std::vector<double> d(seqs[j].size() * st, 0.0);
    for (size_t i = 0; i < seqs[j].size(); ++i) {
      const int64_t n = seqs[j][i];
      if (cu[n + 1] <= (j + 1) * L) std::copy(Wh.begin() + n * st, Wh.begin() + (n + 1) * st, d.begin() + i * st);
    }
    return d;
  };
  std::vector<std::vector<double>> dS(R);
  for (int64_t j = 0; j < R; ++j) {
    const Grads a = backward(local[j], rows(W, j * L, (j + 1) * L, HV * K), local_dht(j), qla::DType::kFloat64);
    dS[j].assign(a.dh0.begin(), a.dh0.begin() + st);  // meaningful where the first sequence started earlier
  }
  for (int64_t j = 0; j < R; ++j) {
    const std::vector<int64_t>& sq = seqs[j];
    std::vector<double> dht = local_dht(j);
    const int64_t last = static_cast<int64_t>(sq.size()) - 1, n = sq[last];
    if (cu[n + 1] > (j + 1) * L) {  // goes on: fold back from the rank where it ends
      const int64_t e = (cu[n + 1] - 1) / L;
      std::vector<double> g = dS[e];
      for (int64_t m = e - 1; m > j; --m) fold(g, sent[m].M, dS[m], HV, K, true);
      std::copy(g.begin(), g.end(), dht.begin() + last * st);
    }
    const Grads b = backward(local[j], rows(W, j * L, (j + 1) * L, HV * K), dht, qla::DType::kFloat64);
    const std::string at = "rank " + std::to_string(j) + " of " + std::to_string(R) + ": ";
    EXPECT_LT(rel_l2(b.dq, rows(gref.dq, j * L, (j + 1) * L, H * K)), 1e-10) << at << "dq";
    EXPECT_LT(rel_l2(b.dk, rows(gref.dk, j * L, (j + 1) * L, H * K)), 1e-10) << at << "dk";
    EXPECT_LT(rel_l2(b.dv, rows(gref.dv, j * L, (j + 1) * L, HV * K)), 1e-10) << at << "dv";
    EXPECT_LT(rel_l2(b.dg, rows(gref.dg, j * L, (j + 1) * L, HV)), 1e-10) << at << "dg";
    EXPECT_LT(rel_l2(b.dbeta, rows(gref.dbeta, j * L, (j + 1) * L, HV)), 1e-10) << at << "dbeta";
    for (size_t i = 0; i < sq.size(); ++i) {
      if (cu[sq[i]] < j * L) continue;  // started earlier: its h0 is the first rank's
      const std::vector<double> d = rows(b.dh0, i, i + 1, st);
      EXPECT_LT(rel_l2(d, rows(gref.dh0, sq[i], sq[i] + 1, st)), 1e-10) << at << "dh0 of sequence " << sq[i];
    }
  }
}

// A sequence over every rank (crossed whole by the middle ones), then one that ends exactly at a
// boundary with an empty sequence right there, and sequences crossing one boundary each.
TEST(CpuContextParallel, OneSequenceOverEveryRank) {
  for (int64_t R : {2, 3, 4}) run_cp({R * 48 - 5, 5}, R, 11 + static_cast<uint32_t>(R));
}

TEST(CpuContextParallel, BoundariesEmptyAndCrossingSequences) {
  run_cp({48, 0, 30, 18}, 2, 21);
  run_cp({48, 0, 70, 50, 24}, 4, 22);
  run_cp({100, 44, 0, 1, 99}, 4, 23);
}

}  // namespace
