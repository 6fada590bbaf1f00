package libserve

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"
)

// Two copies of the fixture share the cores as tenants: every output matches, each completes
// once, and the profile says what it measured.
func TestTenantsShareTheCores(t *testing.T) {
	f := loadFixture(t)
	rt := newRuntime(t, nil)
	models, err := rt.AddTenants([]Tenant{
		{Dir: fixtureDir, Name: "tenant-a", QoS: 100 * time.Millisecond},
		{Dir: fixtureDir, QoS: time.Nanosecond},
	}, &TenantOptions{Scheme: "fixed-2", Levels: 3, LevelStep: 0.5})
	if err != nil {
		t.Fatalf("AddTenants: %v", err)
	}
	if len(models) != 2 {
		t.Fatalf("%d models for 2 tenants", len(models))
	}
	for _, m := range models {
		defer m.Close()
	}
	feasible, err := models[0].TenantFeasible()
	if err != nil || !feasible {
		t.Errorf("tenant-a (100 ms): feasible %v, %v", feasible, err)
	}
	if feasible, err := models[1].TenantFeasible(); err != nil || feasible {
		t.Errorf("a QoS of 1 ns: feasible %v, %v; want flagged", feasible, err)
	}
	if solo, err := models[0].TenantSolo(); err != nil || solo <= 0 || solo >= 100*time.Millisecond {
		t.Errorf("TenantSolo = %v, %v", solo, err)
	}
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 20; i++ {
				k := (g + i) % len(f.Inputs)
				out, err := models[(g+i)%2].Submit(context.Background(), f.Inputs[k])
				if err != nil || !closeEnough(out, f.Outputs[k]) {
					t.Errorf("tenant %d input %d: %v, %v; want %v", (g+i)%2, k, out, err, f.Outputs[k])
				}
			}
		}(g)
	}
	wg.Wait()
	checkExactlyOnce(t, rt)
	models[0].Close()
	if _, err := models[0].TenantFeasible(); !errors.Is(err, ErrClosed) {
		t.Errorf("TenantFeasible after Close: %v, want ErrClosed", err)
	}
}

// Bad groups are refused with the error that names the fault, and nothing serves.
func TestBadTenantsAreRefused(t *testing.T) {
	rt := newRuntime(t, nil)
	plain := loadModel(t, rt, nil)
	if _, err := plain.TenantFeasible(); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "not a tenant") {
		t.Errorf("TenantFeasible of a plain model: %v", err)
	}
	ok := Tenant{Dir: fixtureDir, QoS: time.Second}
	cases := []struct {
		tenants []Tenant
		opts    *TenantOptions
		code    Code
		want    string
	}{
		{nil, nil, CodeInvalidArgument, "0 tenant models"},
		{[]Tenant{{Dir: fixtureDir}}, nil, CodeInvalidArgument, "QoS target of 0s"},
		{[]Tenant{{Dir: fixtureDir, QoS: 2 * time.Hour}}, nil, CodeInvalidArgument, "at most 3600s"},
		{[]Tenant{{Dir: fixtureDir + "/missing", QoS: time.Second}}, nil, CodeNotFound, "missing"},
		{[]Tenant{ok}, &TenantOptions{Scheme: "fastest"}, CodeInvalidArgument, "unknown tenant policy `fastest`"},
		{[]Tenant{ok}, &TenantOptions{Levels: 17}, CodeInvalidArgument, "17 interference levels"},
		{[]Tenant{ok}, &TenantOptions{Cores: 4096}, CodeInvalidArgument, "a pool of 4096 cores"},
	}
	for _, c := range cases {
		models, err := rt.AddTenants(c.tenants, c.opts)
		var e *Error
		if err == nil || !errors.As(err, &e) || e.Code != c.code || !strings.Contains(e.Message, c.want) {
			t.Errorf("%+v %+v: %v, %v; want %v with %q", c.tenants, c.opts, models, err, c.code, c.want)
		}
	}
	if s := stats(t, rt); s.Submitted != 0 {
		t.Errorf("%d submitted", s.Submitted)
	}
}
