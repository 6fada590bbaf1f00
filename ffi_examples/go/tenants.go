package libserve

/*
#include <stdbool.h>
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"runtime"
	"strings"
	"time"
	"unsafe"
)

// Tenant is a layer model (mlp, resnet, bert) to serve as a tenant: its directory, its name
// ("" for the directory's name) and its QoS target, the latency its queries should complete
// within (1 ns to one hour; it plans the blocks, submit with a context deadline to enforce it).
type Tenant struct {
	Dir  string
	Name string
	QoS  time.Duration
}

// TenantOptions say how a group of tenants shares the cores. The zero value is the defaults.
type TenantOptions struct {
	// Scheme: "veltair" (default when ""), "veltair-as", "veltair-ac", "layer-wise",
	// "model-wise", "fixed-N" or "prema".
	Scheme string
	// Cores shared: the first Cores CPUs this process may run on; 0 for all of them (at most the
	// CPU backend's compute threads).
	Cores int
	// Levels of interference profiled (1 to 16) and the slowdown each adds (0 to 10); Levels 0
	// keeps the defaults (5 levels, 0.25 apart) and ignores LevelStep.
	Levels    int
	LevelStep float64
	// AdmissionBound of each tenant; 0 for the runtime's.
	AdmissionBound int
}

func (o *TenantOptions) build(tenants []Tenant) (*C.serve_tenants, error) {
	var t *C.serve_tenants
	if err := takeError(C.serve_tenants_new(&t)); err != nil {
		return nil, err
	}
	fail := func(err error) (*C.serve_tenants, error) {
		C.serve_tenants_free(t)
		return nil, err
	}
	for _, tn := range tenants {
		if strings.IndexByte(tn.Dir, 0) >= 0 || strings.IndexByte(tn.Name, 0) >= 0 {
			return fail(invalid("tenant %q: a NUL byte in its directory or name", tn.Name))
		}
		if tn.QoS <= 0 {
			return fail(invalid("tenant %q: a QoS target of %v (above 0, at most 1h)", tn.Name, tn.QoS))
		}
		cdir := C.CString(tn.Dir)
		var cname *C.char
		if tn.Name != "" {
			cname = C.CString(tn.Name)
		}
		err := takeError(C.serve_tenants_add_model(t, cdir, cname, C.uint64_t(tn.QoS.Nanoseconds())))
		C.free(unsafe.Pointer(cdir))
		C.free(unsafe.Pointer(cname))
		if err != nil {
			return fail(err)
		}
	}
	if o == nil {
		return t, nil
	}
	if o.Scheme != "" {
		if strings.IndexByte(o.Scheme, 0) >= 0 {
			return fail(invalid("a NUL byte in the scheme"))
		}
		cs := C.CString(o.Scheme)
		err := takeError(C.serve_tenants_set_scheme(t, cs))
		C.free(unsafe.Pointer(cs))
		if err != nil {
			return fail(err)
		}
	}
	if o.Cores < 0 || o.Levels < 0 || o.AdmissionBound < 0 {
		return fail(invalid("negative cores, levels or admission bound"))
	}
	if err := takeError(C.serve_tenants_set_cores(t, C.size_t(o.Cores))); err != nil {
		return fail(err)
	}
	if o.Levels != 0 {
		if err := takeError(C.serve_tenants_set_levels(t, C.size_t(o.Levels), C.double(o.LevelStep))); err != nil {
			return fail(err)
		}
	}
	if o.AdmissionBound != 0 {
		if err := takeError(C.serve_tenants_set_admission_bound(t, C.size_t(o.AdmissionBound))); err != nil {
			return fail(err)
		}
	}
	return t, nil
}

// AddTenants serves tenants as layer models sharing the CPU cores under libserve's tenant
// scheduler (VELTAIR), each with its own QoS target: each is loaded and profiled (milliseconds
// to seconds), then all serve together. It returns one Model per tenant, in order; submit to
// them as to any mlp. Errors: those of LoadModel for a directory, CodeUnsupported (a device
// backend), CodeInvalidArgument (no tenant, a QoS out of range, a model without layers, a bad
// option), CodeShutdown. On error nothing serves.
func (r *Runtime) AddTenants(tenants []Tenant, opts *TenantOptions) ([]*Model, error) {
	t, err := opts.build(tenants)
	if err != nil {
		return nil, err
	}
	defer C.serve_tenants_free(t)
	s := r.s
	s.mu.RLock()
	if s.closed {
		s.mu.RUnlock()
		return nil, errRuntimeClosed()
	}
	n := len(tenants)
	var slots **C.serve_model
	if n > 0 {
		slots = (**C.serve_model)(C.calloc(C.size_t(n), C.size_t(unsafe.Sizeof((*C.serve_model)(nil)))))
		defer C.free(unsafe.Pointer(slots))
	}
	err = takeError(C.serve_runtime_add_tenants(s.ptr, t, slots, C.size_t(n)))
	s.mu.RUnlock()
	runtime.KeepAlive(r)
	if err != nil {
		return nil, err
	}
	models := make([]*Model, n)
	for i, ptr := range unsafe.Slice(slots, n) {
		models[i] = r.newModel(ptr)
	}
	return models, nil
}

// TenantFeasible says whether a model of AddTenants meets its QoS target alone on every core of
// the pool, its whole chain of layers as profiled (when not, it is served best-effort).
// CodeInvalidArgument for a model that is not a tenant; ErrClosed after Close.
func (m *Model) TenantFeasible() (bool, error) {
	var out C.bool
	err := m.withPtr(func(p *C.serve_model) error { return takeError(C.serve_model_tenant_feasible(p, &out)) })
	return bool(out), err
}

// TenantSolo is a model of AddTenants' profiled time alone on every core of the pool, its whole
// chain of layers. CodeInvalidArgument for a model that is not a tenant; ErrClosed after Close.
func (m *Model) TenantSolo() (time.Duration, error) {
	var ns C.uint64_t
	err := m.withPtr(func(p *C.serve_model) error { return takeError(C.serve_model_tenant_solo_ns(p, &ns)) })
	return time.Duration(ns), err
}

// withPtr runs f on the open model's handle.
func (m *Model) withPtr(f func(*C.serve_model) error) error {
	m.s.mu.RLock()
	defer m.s.mu.RUnlock()
	if m.s.closed {
		return ErrClosed
	}
	err := f(m.s.ptr)
	runtime.KeepAlive(m)
	return err
}
