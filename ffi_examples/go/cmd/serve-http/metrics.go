package main

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"libserve"
)

// openMetricsEOF ends an OpenMetrics text.
const openMetricsEOF = "# EOF\n"

// metrics serves GET /metrics: libserve's metrics (Runtime.Metrics) followed by the server's own
// series, in the OpenMetrics text format Prometheus scrapes. The server's series count what
// admission control does before requests reach libserve (so the operator sees HTTP-level
// shedding, which libserve never sees), labelled with the model's name like libserve's:
//
//	serve_http_requests_admitted_total  counter  requests admitted by admission control
//	serve_http_requests_shed_total      counter  requests answered 503 at once by admission control
//	serve_http_requests_pending         gauge    admitted, not yet answered (bodies being read included)
//	serve_http_departure_rate           gauge    successful completions per busy second, as measured
//	                                             by admission control (0 until measured)
func (s *server) metrics(w http.ResponseWriter, _ *http.Request) {
	text := openMetricsEOF
	if s.libMetrics != nil {
		var err error
		if text, err = s.libMetrics(); err != nil {
			code := libserve.CodeOf(err)
			writeError(w, httpStatus(code), code, err.Error())
			return
		}
	}
	lib, ok := strings.CutSuffix(text, openMetricsEOF)
	if !ok {
		writeError(w, http.StatusInternalServerError, libserve.CodeInternal, "libserve's metrics text does not end with # EOF")
		return
	}
	var b strings.Builder
	b.WriteString(lib)
	c := s.admit.counters()
	label := `{model="` + escapeLabel(s.modelName) + `"}`
	family := func(name, typ, help, sample, value string) {
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s %s\n%s%s %s\n", name, help, name, typ, sample, label, value)
	}
	family("serve_http_requests_admitted", "counter", "Requests admitted by the HTTP server's admission control.",
		"serve_http_requests_admitted_total", strconv.FormatUint(c.admitted, 10))
	family("serve_http_requests_shed", "counter", "Requests the HTTP server answered 503 at once, before they reached libserve.",
		"serve_http_requests_shed_total", strconv.FormatUint(c.shed, 10))
	family("serve_http_requests_pending", "gauge", "Requests admitted and not yet answered, bodies being read included.",
		"serve_http_requests_pending", strconv.Itoa(c.pending))
	family("serve_http_departure_rate", "gauge", "Successful completions per busy second measured by admission control (0 until measured).",
		"serve_http_departure_rate", strconv.FormatFloat(c.rate, 'g', -1, 64))
	b.WriteString(openMetricsEOF)
	w.Header().Set("Content-Type", libserve.MetricsContentType)
	w.WriteHeader(http.StatusOK)
	// A write error here means the client went away.
	_, _ = w.Write([]byte(b.String()))
}

// escapeLabel escapes a label value for the text format: backslash, double quote and newline.
func escapeLabel(v string) string {
	return strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`).Replace(v)
}
