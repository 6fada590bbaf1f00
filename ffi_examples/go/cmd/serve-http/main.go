// Command serve-http serves a libserve model over HTTP.
//
//	go build ./cmd/serve-http && ./serve-http -model ../testdata/mlp_4_8_3 -addr 127.0.0.1:8080
//	curl -s localhost:8080/v1/infer -d '{"input":[-0.75,-0.25,0.25,0.75]}'
//	{"output":[-0.2809799,0.13719752,-0.03692965]}
//
// POST /v1/infer takes the request forms of `serve infer`: {"input":[...]} (mlp),
// {"tokens":[...]} (lstm, seq2seq) or {"tokens":[...],"parents":[...]} (treelstm), and answers
// {"output":[...]} ({"tokens":[...]} for seq2seq) or, on failure, an error status with
// {"error":{"code":"BUSY","message":"..."}}: INVALID_ARGUMENT → 400 (413 for a body over 1 MiB),
// BUSY, SHUTDOWN, UNAVAILABLE and CANCELLED → 503 (with Retry-After), DEADLINE_EXCEEDED → 504,
// UNSUPPORTED → 501, others → 500. Each request has the -timeout deadline, or the shorter one
// its timeout_ms query parameter asks for. GET /v1/model describes the model; GET /healthz
// answers ok; GET /metrics answers libserve's metrics and the server's own (requests admitted
// and shed by admission control, labelled with the model's -name) as OpenMetrics text, which
// Prometheus scrapes; other paths answer 404 and other methods 405, with the same JSON error body.
//
// Admission control sheds load before queues hold more than the QoS allows: a request whose
// predicted latency (requests in progress / measured completion rate + service time) exceeds
// -qos (default -timeout/2, or its own shorter timeout) is answered 503 BUSY at once, before its
// body is read; -admit-floor requests are admitted whatever the prediction, at most -max-pending.
//
// On SIGINT or SIGTERM the server stops accepting connections, lets requests in progress finish
// (up to -drain), then shuts the runtime down.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"libserve"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:8080", "listen address")
	modelDir := flag.String("model", "", "model directory (model.toml + weights.safetensors)")
	name := flag.String("name", "", "the model's name in metrics and messages (default: the directory's name)")
	backend := flag.String("backend", "auto", "backend: auto, cpu or cuda")
	cpuThreads := flag.Int("cpu-threads", 0, "CPU backend compute threads (0 = one per core)")
	maxBatch := flag.Int("max-batch", 32, "most requests per batched task")
	maxWait := flag.Duration("max-wait", 0, "longest wait for a fuller batch (0 = none)")
	workers := flag.Int("workers", 1, "workers (backend streams) of the model")
	admissionBound := flag.Int("admission-bound", 0, "requests in flight before BUSY (0 = libserve's default)")
	timeout := flag.Duration("timeout", 5*time.Second, "deadline of each request")
	qos := flag.Duration("qos", 0, "latency target of admission control: requests predicted to take longer get 503 at once (0 = -timeout/2)")
	maxPending := flag.Int("max-pending", defaultMaxPending, "most requests admitted at once; more get 503")
	admitFloor := flag.Int("admit-floor", defaultAdmitFloor, "requests admitted whatever the prediction (a cold server has none)")
	drain := flag.Duration("drain", 10*time.Second, "how long requests in progress may finish at shutdown")
	flag.Parse()
	if *modelDir == "" || flag.NArg() > 0 {
		fmt.Fprintln(os.Stderr, "usage: serve-http -model DIR [flags]")
		flag.PrintDefaults()
		os.Exit(2)
	}
	if *timeout <= 0 || *qos < 0 || *maxPending <= 0 || *admitFloor <= 0 {
		fmt.Fprintln(os.Stderr, "serve-http: -timeout, -max-pending and -admit-floor must be positive, -qos not negative")
		os.Exit(2)
	}
	if *name == "" {
		abs, err := filepath.Abs(*modelDir)
		if err != nil {
			log.Fatal(err)
		}
		*name = filepath.Base(abs)
	}
	cfg := config{Timeout: *timeout, QoS: *qos, MaxPending: *maxPending, AdmitFloor: *admitFloor, ModelName: *name}
	if err := run(*addr, *modelDir, cfg, *drain,
		&libserve.RuntimeOptions{Backend: *backend, CPUThreads: *cpuThreads},
		&libserve.ModelOptions{MaxBatch: *maxBatch, MaxWait: *maxWait, Workers: *workers, AdmissionBound: *admissionBound, Name: *name},
	); err != nil {
		log.Fatal(err)
	}
}

func run(addr, modelDir string, cfg config, drain time.Duration, ro *libserve.RuntimeOptions, mo *libserve.ModelOptions) error {
	rt, err := libserve.NewRuntime(ro)
	if err != nil {
		return err
	}
	defer rt.Shutdown(drain)
	m, err := rt.LoadModel(modelDir, mo)
	if err != nil {
		return err
	}
	defer m.Close()

	cfg.Metrics = rt.Metrics
	srv := newServer(addr, newHandler(m, cfg), cfg.Timeout)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	errc := make(chan error, 1)
	go func() { errc <- srv.ListenAndServe() }()
	log.Printf("serving %s model %s (libserve %s, %s backend) on http://%s", m.Kind(), modelDir, libserve.Version(), rt.Backend(), addr)
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	log.Print("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), drain)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return nil
}

// maxHeaderBytes bounds a request's headers: larger ones are answered 431.
const maxHeaderBytes = 64 << 10

// newServer serves h on addr. What one connection can hold is bounded: headers (maxHeaderBytes,
// within 5 s), the whole request (maxBodyBytes, within 30 s), the answer (within the request
// timeout plus 30 s), and an idle keep-alive connection (2 min).
func newServer(addr string, h http.Handler, timeout time.Duration) *http.Server {
	return &http.Server{
		Addr:              addr,
		Handler:           h,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      30*time.Second + timeout,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    maxHeaderBytes,
	}
}
