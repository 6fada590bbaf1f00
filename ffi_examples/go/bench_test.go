package libserve

import (
	"context"
	"fmt"
	"testing"
)

// BenchmarkRoundTrip measures one request's submit → result round trip on the fixture mlp
// (4 → 8 → 3, CPU backend, no batching wait), through the bindings (Model.Submit: tag map,
// poller goroutine, result channel and its busy-wait, context) and through the bare C path
// measured in the same run (serve_submit_f32 then a blocking serve_queue_next on a private
// queue, called from Go), each sequentially and from 4×GOMAXPROCS goroutines. The Go sub-benchmarks report
// "ns-over-C/op", the bindings' overhead over the C path, and "x-C", their time as a multiple
// of it; a summary line follows the four results.
//
//	go test -run '^$' -bench RoundTrip -benchtime 2s
func BenchmarkRoundTrip(b *testing.B) {
	f := loadFixture(b)
	rt := newRuntime(b, nil)
	m := loadModel(b, rt, nil)
	in := f.Inputs[0]
	const parallelism = 4
	var cSeq, goSeq, cPar, goPar float64
	perOp := func(b *testing.B) float64 { return float64(b.Elapsed().Nanoseconds()) / float64(b.N) }

	b.Run("C/sequential", func(b *testing.B) {
		raw, err := newRawPath()
		if err != nil {
			b.Fatal(err)
		}
		defer raw.close()
		out := make([]float32, m.OutputLen())
		b.ResetTimer()
		for range b.N {
			if err := raw.roundTrip(m, in, out); err != nil {
				b.Fatal(err)
			}
		}
		b.StopTimer()
		cSeq = perOp(b)
	})
	b.Run("Go/sequential", func(b *testing.B) {
		ctx := context.Background()
		for range b.N {
			if _, err := m.Submit(ctx, in); err != nil {
				b.Fatal(err)
			}
		}
		b.StopTimer()
		goSeq = perOp(b)
		b.ReportMetric(goSeq-cSeq, "ns-over-C/op")
		b.ReportMetric(goSeq/cSeq, "x-C")
	})
	b.Run("C/parallel", func(b *testing.B) {
		b.SetParallelism(parallelism)
		b.RunParallel(func(pb *testing.PB) {
			raw, err := newRawPath()
			if err != nil {
				b.Error(err)
				return
			}
			defer raw.close()
			out := make([]float32, m.OutputLen())
			for pb.Next() {
				if err := raw.roundTrip(m, in, out); err != nil {
					b.Error(err)
					return
				}
			}
		})
		b.StopTimer()
		cPar = perOp(b)
	})
	b.Run("Go/parallel", func(b *testing.B) {
		b.SetParallelism(parallelism)
		ctx := context.Background()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if _, err := m.Submit(ctx, in); err != nil {
					b.Error(err)
					return
				}
			}
		})
		b.StopTimer()
		goPar = perOp(b)
		b.ReportMetric(goPar-cPar, "ns-over-C/op")
		b.ReportMetric(goPar/cPar, "x-C")
	})
	if cSeq > 0 && goSeq > 0 && cPar > 0 && goPar > 0 {
		// Printed directly: the log of a benchmark with sub-benchmarks is not shown.
		fmt.Printf("Go binding overhead over the C path: sequential %+.2f µs/op (%.1f → %.1f µs, ×%.2f); parallel %+.2f µs/op (%.1f → %.1f µs, ×%.2f)\n",
			(goSeq-cSeq)/1e3, cSeq/1e3, goSeq/1e3, goSeq/cSeq, (goPar-cPar)/1e3, cPar/1e3, goPar/1e3, goPar/cPar)
	}
	checkExactlyOnce(b, rt)
}
