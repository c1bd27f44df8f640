// TwoBitSegmentLevels: the "auto" levels (threshold, magnitude) of every segment of a bucket, from
// its flat gradient g and residual b, on the CPU. Built on first use by native_ops.py.
//
// The same arithmetic as reference_codec.auto_levels: x = b + g in float32; a = |x| in float64;
// the mean (or, "rms", the root mean square) of a; "lsq": for each candidate threshold
// mean * multiple, how many a reach it and their sum, the candidate with the largest sum^2 / count
// (the first on ties) and its mean as the magnitude. Sums run in float64 over float32 values, in
// partial sums (the order does not change the float32 level, as the reference's docstring says);
// each level is rounded to float32 once, times the rule's factor first, never below FLT_MIN.
// Built without -ffast-math and with -ffp-contract=off: no reassociation, no fused multiply-add.
#include <cfloat>
#include <cmath>
#include <string>

#include "twobit_ops.h"

namespace twobit {

constexpr int kMultiples = 9;  // wire.OPT_MULTIPLES

REGISTER_OP("TwoBitSegmentLevels")
    .Input("g: float")
    .Input("b: float")
    .Input("starts: int64")
    .Input("lengths: int64")
    .Input("multiples: double")
    .Input("factor: double")
    .Attr("rule: {'lsq', 'mean', 'rms'}")
    .Output("thresholds: float")
    .Output("magnitudes: float")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(2));
      c->set_output(1, c->input(2));
      return tensorflow::OkStatus();
    });

static float ToLevel(double y, double factor) {
  if (factor > 0) y = y * factor;
  const float f = static_cast<float>(y);
  return f < FLT_MIN ? FLT_MIN : f;  // NaN stays NaN
}

static inline double Abs(const float* b, const float* g, int64_t i) {
  return std::fabs(static_cast<double>(b[i] + g[i]));
}

static inline V4d AbsVec(const float* b, const float* g) {
  V4f bv, gv;
  __builtin_memcpy(&bv, b, sizeof bv);
  __builtin_memcpy(&gv, g, sizeof gv);
  const V4d x = __builtin_convertvector(bv + gv, V4d);  // the float32 sum, then widened
  return (V4d)((V4i)x & (V4i){INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX});
}

// Sum of |x| (or x^2) over n values, in 8 partial sums.
TWOBIT_CLONES static double Total(const float* b, const float* g, int64_t n, bool squares) {
  V4d acc[2] = {{0.0, 0.0, 0.0, 0.0}, {0.0, 0.0, 0.0, 0.0}};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int v = 0; v < 2; ++v) {
      const V4d a = AbsVec(b + i + 4 * v, g + i + 4 * v);
      acc[v] += squares ? a * a : a;
    }
  }
  double total = 0.0;
  for (int v = 0; v < 2; ++v)
    for (int l = 0; l < 4; ++l) total += acc[v][l];
  for (; i < n; ++i) {
    const double a = Abs(b, g, i);
    total += squares ? a * a : a;
  }
  return total;
}

// For each candidate ts[c] (ascending): how many of the n values' |x| are >= it, and their sum.
// Each value's bin (how many candidates it reaches) comes from vector comparisons; counts and
// sums are kept per bin, in 8 tables so that neighbouring values never wait on one another, and
// candidate c's are those of the bins above c.
TWOBIT_CLONES static void Candidates(const float* b, const float* g, int64_t n,
                                     const double* ts, double* counts, double* sums) {
  constexpr int kBins = kMultiples + 1;
  int64_t bin_count[8][kBins] = {{0}};
  double bin_sum[8][kBins] = {{0.0}};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    V4d a[2];
    V4i bin[2];
    for (int v = 0; v < 2; ++v) {
      a[v] = AbsVec(b + i + 4 * v, g + i + 4 * v);
      bin[v] = (V4i){0, 0, 0, 0};
    }
    for (int c = 0; c < kMultiples; ++c) {
      const V4d t = {ts[c], ts[c], ts[c], ts[c]};
      for (int v = 0; v < 2; ++v) bin[v] -= (a[v] >= t);  // a comparison is -1 where true
    }
    for (int v = 0; v < 2; ++v) {
      for (int l = 0; l < 4; ++l) {
        bin_count[4 * v + l][bin[v][l]] += 1;
        bin_sum[4 * v + l][bin[v][l]] += a[v][l];
      }
    }
  }
  for (; i < n; ++i) {
    const double a = Abs(b, g, i);
    int bin = 0;
    for (int c = 0; c < kMultiples; ++c) bin += a >= ts[c];
    bin_count[0][bin] += 1;
    bin_sum[0][bin] += a;
  }
  int64_t count = 0;
  double sum = 0.0;
  for (int k = kBins - 1; k >= 1; --k) {
    for (int l = 0; l < 8; ++l) {
      count += bin_count[l][k];
      sum += bin_sum[l][k];
    }
    counts[k - 1] = static_cast<double>(count);
    sums[k - 1] = sum;
  }
}

class SegmentLevelsOp : public OpKernel {
 public:
  explicit SegmentLevelsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string rule;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rule", &rule));
    lsq_ = rule == "lsq";
    rms_ = rule == "rms";
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& g = ctx->input(0);
    const Tensor& b = ctx->input(1);
    const auto starts = ctx->input(2).flat<int64_t>();
    const auto lengths = ctx->input(3).flat<int64_t>();
    const auto multiples = ctx->input(4).flat<double>();
    const double factor = ctx->input(5).scalar<double>()();
    const int64_t n = g.NumElements();
    OP_REQUIRES(ctx, b.NumElements() == n,
                errors::InvalidArgument("g and b differ in size: ", n, " and ", b.NumElements()));
    OP_REQUIRES(ctx, starts.size() == lengths.size(),
                errors::InvalidArgument("starts and lengths differ in size"));
    OP_REQUIRES(ctx, multiples.size() == kMultiples,
                errors::InvalidArgument("expected ", kMultiples, " multiples"));
    const int64_t segments = starts.size();
    for (int64_t s = 0; s < segments; ++s) {
      OP_REQUIRES(ctx, starts(s) >= 0 && lengths(s) >= 0 && starts(s) + lengths(s) <= n,
                  errors::InvalidArgument("segment ", s, " lies outside the ", n, " values"));
    }
    Tensor* t_out = nullptr;
    Tensor* v_out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({segments}), &t_out));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({segments}), &v_out));
    const float* gp = g.flat<float>().data();
    const float* bp = b.flat<float>().data();
    auto t = t_out->flat<float>();
    auto v = v_out->flat<float>();
    for (int64_t s = 0; s < segments; ++s) {
      const int64_t len = lengths(s);
      if (len == 0) {  // an empty tensor's levels, as the reference's
        t(s) = v(s) = 1.0f;
        continue;
      }
      const float* gs = gp + starts(s);
      const float* bs = bp + starts(s);
      const double mean = Total(bs, gs, len, rms_) / static_cast<double>(len);
      if (!lsq_) {
        t(s) = v(s) = ToLevel(rms_ ? std::sqrt(mean) : mean, factor);
        continue;
      }
      double ts[kMultiples], counts[kMultiples], sums[kMultiples];
      for (int c = 0; c < kMultiples; ++c) ts[c] = mean * multiples(c);
      Candidates(bs, gs, len, ts, counts, sums);
      int best = 0;
      double best_score = 0.0;
      for (int c = 0; c < kMultiples; ++c) {
        const double score = counts[c] > 0 ? sums[c] * sums[c] / counts[c] : 0.0;
        if (c == 0 || score > best_score) {
          best = c;
          best_score = score;
        }
      }
      t(s) = ToLevel(ts[best], factor);
      v(s) = ToLevel(counts[best] > 0 ? sums[best] / counts[best] : ts[best], factor);
    }
  }

 private:
  bool lsq_ = true;
  bool rms_ = false;
};

REGISTER_KERNEL_BUILDER(Name("TwoBitSegmentLevels").Device(tensorflow::DEVICE_CPU),
                        SegmentLevelsOp);

}  // namespace twobit
