package libserve_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"libserve"
)

// Serve the committed 4 → 8 → 3 mlp fixture on the CPU backend and run one request with a
// deadline.
func ExampleModel_Submit() {
	rt, err := libserve.NewRuntime(&libserve.RuntimeOptions{Backend: "cpu", CPUThreads: 1})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer rt.Close()
	m, err := rt.LoadModel("../testdata/mlp_4_8_3", nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	y, err := m.Submit(ctx, []float32{-0.75, -0.25, 0.25, 0.75})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%s model, output %.4f\n", m.Kind(), y)

	_, err = m.Submit(ctx, []float32{1, 2})
	fmt.Println(errors.Is(err, libserve.ErrInvalidArgument), libserve.CodeOf(err))
	// Output:
	// mlp model, output [-0.2810 0.1372 -0.0369]
	// true INVALID_ARGUMENT
}

// Serve the committed seq2seq fixture under cellular batching with two workers: a token
// sequence in, the decoded token ids out (Output.Tokens; Output.F32 is nil).
func ExampleModel_SubmitTokens() {
	rt, err := libserve.NewRuntime(&libserve.RuntimeOptions{Backend: "cpu", CPUThreads: 1})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer rt.Close()
	m, err := rt.LoadModel("../testdata/seq2seq_small",
		&libserve.ModelOptions{Policy: libserve.PolicyCellular, Workers: 2})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	out, err := m.SubmitTokens(ctx, []uint32{28, 21})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(m.Kind(), out.Tokens, out.F32 == nil)

	_, err = m.SubmitTokens(ctx, []uint32{40}) // the vocabulary is 0..39
	fmt.Println(libserve.CodeOf(err))

	_, err = rt.LoadModel("../testdata/lstm_small", &libserve.ModelOptions{Policy: libserve.PolicyTimeout})
	fmt.Println(libserve.CodeOf(err))
	// Output:
	// seq2seq [6 6 2] true
	// INVALID_ARGUMENT
	// UNSUPPORTED
}
