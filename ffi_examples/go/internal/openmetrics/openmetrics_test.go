package openmetrics

import (
	"strings"
	"testing"
)

const good = `# HELP a_requests Requests.
# TYPE a_requests counter
a_requests_total{model="m",code="OK"} 3
a_requests_total{code="BUSY",model="m \"q\" \\ \n"} 1
# TYPE a_seconds histogram
a_seconds_bucket{le="+Inf"} 2
a_seconds_sum 0.5
a_seconds_count 2
# HELP a_depth Depth.
# TYPE a_depth gauge
a_depth -1
# EOF
`

func TestParseAcceptsValidText(t *testing.T) {
	e, err := Parse(good)
	if err != nil {
		t.Fatal(err)
	}
	if v, ok := e.Get("a_requests_total", "code", "OK", "model", "m"); !ok || v != 3 {
		t.Errorf("a_requests_total OK = %v, %v", v, ok)
	}
	if v, ok := e.Get("a_requests_total", "model", "m \"q\" \\ \n", "code", "BUSY"); !ok || v != 1 {
		t.Errorf("escaped label: %v, %v", v, ok)
	}
	if v, ok := e.Get("a_depth"); !ok || v != -1 {
		t.Errorf("a_depth = %v, %v", v, ok)
	}
	if e.Types["a_seconds"] != "histogram" || len(e.Samples) != 6 {
		t.Errorf("types %v, %d samples", e.Types, len(e.Samples))
	}
}

// Each edit of the valid text breaks one rule, which Parse must catch.
func TestParseRejectsInvalidText(t *testing.T) {
	for _, tc := range []struct{ name, from, to string }{
		{"no EOF", "# EOF\n", ""},
		{"two EOF", "# EOF\n", "# EOF\n# EOF\n"},
		{"text after EOF", "# EOF\n", "# EOF\na_depth 1\n"},
		{"no final newline", "# EOF\n", "# EOF"},
		{"sample before TYPE", "# TYPE a_requests counter\n", ""},
		{"wrong family", "a_seconds_sum", "a_second_sum"},
		{"counter without _total", "a_requests_total{model=\"m\",code=\"OK\"}", "a_requests{model=\"m\",code=\"OK\"}"},
		{"duplicate sample", "a_seconds_sum 0.5\n", "a_seconds_sum 0.5\na_seconds_sum 0.5\n"},
		{"same labels reordered", "code=\"BUSY\",model=\"m \\\"q\\\" \\\\ \\n\"", "code=\"OK\",model=\"m\""},
		{"family split", "# EOF\n", "# TYPE a_requests counter\n# EOF\n"},
		{"second TYPE", "# TYPE a_depth gauge\n", "# TYPE a_depth gauge\n# TYPE a_depth gauge\n"},
		{"second HELP", "# HELP a_depth Depth.\n", "# HELP a_depth Depth.\n# HELP a_depth Depth.\n"},
		{"unknown type", "a_depth gauge", "a_depth meter"},
		{"unknown comment", "# EOF\n", "# hello\n# EOF\n"},
		{"unquoted label", `le="+Inf"`, `le=+Inf`},
		{"unterminated label", `le="+Inf"}`, `le="+Inf}`},
		{"bad value", "a_depth -1", "a_depth one"},
		{"no value", "a_depth -1", "a_depth"},
		{"empty line", "# EOF\n", "\n# EOF\n"},
		{"repeated label", `{le="+Inf"}`, `{le="+Inf",le="1"}`},
	} {
		bad := strings.Replace(good, tc.from, tc.to, 1)
		if bad == good {
			t.Fatalf("%s: the edit does not apply", tc.name)
		}
		if _, err := Parse(bad); err == nil {
			t.Errorf("%s: accepted:\n%s", tc.name, bad)
		}
	}
}
